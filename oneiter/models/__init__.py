"""Built-in models for `--model NAME` (pure torch, no torchvision), installed as `oneiter.models`.

This module sits between the CLI / `oneiter.runtime.modelspec` and the model files next to it (`resnet.py`,
`mobilenet.py`, `llama.py`). It holds the `MODELS` registry of builders; each builder follows the model
contract (`builder(batch_size=..., **model_args) -> (model, inputs, loss_fn)`, see `oneiter.runtime.modelspec`).

Importing this package does not import torch: the registered builders are small wrappers that import
their model file on first call, so `oneiter models` lists quickly.

- `resnet.py`    ResNet-18 (torchvision-compatible state_dict)
- `mobilenet.py` MobileNetV2 (torchvision-compatible state_dict)
- `llama.py`     a small LLaMA-style decoder (RMSNorm, rotary, SwiGLU)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from mmengine.registry import Registry

from oneiter.errors import ModelError

__all__ = ["MODELS", "list_models", "get_builder"]

MODELS = Registry("oneiter model", scope="oneiter")

# (name, module next to this file, one-line description). The builder function has the same name.
_BUILTINS = (
    ("resnet18", "resnet", "ResNet-18 on random images (torchvision-compatible state_dict)"),
    ("mobilenet_v2", "mobilenet", "MobileNetV2 on random images (torchvision-compatible state_dict)"),
    ("llama_tiny", "llama", "small LLaMA-style decoder (RMSNorm, rotary, SwiGLU) on random tokens"),
)


def _lazy_builder(name: str, module: str, summary: str) -> Callable[..., Any]:
    """A builder that imports `oneiter.models.<module>` (and so torch) only when it is called."""

    def builder(batch_size: int, **model_args: Any) -> Any:
        real = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        return real(batch_size=batch_size, **model_args)

    builder.__name__ = builder.__qualname__ = name
    builder.__module__ = f"{__name__}.{module}"
    builder.__doc__ = f"{summary}.\n\nLazy wrapper around `{__name__}.{module}.{name}`; see it for the model args."
    return builder


for _name, _module, _summary in _BUILTINS:
    MODELS.register_module(name=_name, module=_lazy_builder(_name, _module, _summary))


def _first_doc_line(obj: Any) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0].rstrip(".") if doc else ""


def list_models() -> list[tuple[str, str]]:
    """`(name, one-line description)` of every registered builder, sorted by name."""
    return sorted((name, _first_doc_line(func)) for name, func in MODELS.module_dict.items())


def get_builder(name: str) -> Callable[..., Any]:
    """The builder registered as `name`; raises `ModelError` listing the known names if there is none.

    Looks the name up in the registry's own table (not `Registry.get`, which would fall back to importing
    `name` as a dotted Python path).
    """
    builder = MODELS.module_dict.get(name)
    if builder is None:
        known = ", ".join(n for n, _ in list_models())
        raise ModelError(f"unknown model '{name}': built-in models are {known}; or give path/to/file.py:function")
    return builder
