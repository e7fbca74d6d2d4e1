"""Faults that live where a real target's software stack differs from the reference's — inside the model's code.

The model files of this folder call `patch_functions()` first thing in their builder (a vendor plugin patches
torch functions at import time, before any model binds them) and `apply_fault(model)` at the end; both read the
environment variable `ONEITER_TEST_FAULT` (unset or empty: a clean model) and change the *model's computation*
the way a vendor's stack would, never through oneiter:

    FAMILY:TARGET[:REL][@SHAPE][;FAMILY:TARGET...]        REL: relative error, default 1e-3

Several instance faults at once are separated by `;` (`instance_below64:first:0.02;instance_below64:layers.4:0.01`);
`fault_spec()` and `fault_scale()` read the first.

- `instance:<module path>`  wrap that module instance's `forward` (what accelerate-style hooks and vendor wrappers
  do): its floating outputs are scaled by (1 + REL). `@N` only for calls whose input's last dimension is N (a
  kernel wrong for one shape: a shared block's second call on a smaller feature map); `@rows=N` only for calls
  whose input's first dimension is N (a kernel wrong for one batch size: in a loop of microbatches, the one of N
  rows).
- `instance_below64:<module path>` the same wrapper, outputs scaled unless they are float64 (a device kernel wrong in
  the precisions the run uses, float32 and lower: the same code in float64, which a calibration and a fix run, is
  exact).
- `instance_bwd:<module path>` the same wrapper, exact forward, the gradients flowing back into that call scaled
  (a wrong backward kernel of one module: its output gradient is right, what it hands back is not).
- `class:<ClassName>`       replace `ClassName.forward` for every instance (a vendor plugin's fused-kernel patch).
- `function:<name>`         replace `torch.nn.functional.<name>` everywhere (a wrong kernel): outputs scaled.
- `function_bwd:<name>`     the same function, exact forward, gradients w.r.t. its inputs scaled (a wrong backward
  kernel only).
- `function_f32:<name>`     the same function, outputs scaled only where they are float32 (a plugin's Python-level fast
  path for float32 tensors: the same code run in float64 is exact, so its error looks like float32's noise).
- `stride:<name>`           the same, but wrong only when its first tensor argument is not contiguous from the start
  of its storage (a transposed view, a slice with a storage offset): an NPU stride/format bug.
- `stride_bwd:<name>`       exact forward; the gradients scaled only for such an input (a wrong strided backward).
- `ids:<first id>`          torch.nn.functional.embedding wrong only for token ids >= the first id: the rows it looks
  up for them are scaled, forward and backward (a kernel wrong for rare tokens; `hf_llama.py:build_steps` first
  feeds such ids at step 6).
- `ids_lowp:<first id>`     the same, but only in a lower precision (under autocast, or with bfloat16/float16
  weights): a bf16 kernel wrong for rare tokens, which the same code in float32 does not reproduce.
- `optimizer:<choice>`      the builder's optimizer is another one (`fault_spec()` names it; see vendor_optim.py).
- `root[:REL]`               functional code in the model's own `forward` is off (the builder reads `fault_scale()`).

Patches are undone by `undo_faults()` (tests record many models in one process) and before a new fault is
applied, so building twice never stacks faults.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

__all__ = ["patch_functions", "apply_fault", "undo_faults", "fault_scale", "fault_spec", "ENV"]

ENV = "ONEITER_TEST_FAULT"
_UNDO: list[Callable[[], None]] = []


def undo_faults() -> None:
    while _UNDO:
        _UNDO.pop()()


def _parse() -> tuple[str, str, float, int | None] | None:
    specs = _specs()
    return specs[0] if specs else None


def _specs() -> list[tuple[str, str, float, int | None]]:
    return [_one(text.strip()) for text in os.environ.get(ENV, "").split(";") if text.strip()]


def _one(text: str) -> tuple[str, str, float, int | None]:
    text, _, shape = text.partition("@")
    family, _, rest = text.partition(":")
    target, _, rel = rest.partition(":")
    if family == "root":  # no target: `root` or `root:REL`
        target, rel = "", target
    if shape.startswith("rows="):  # the first dimension instead of the last (negative: `_matches` tells)
        return family, target, float(rel) if rel else 1e-3, -int(shape[len("rows="):]) - 1
    return family, target, float(rel) if rel else 1e-3, int(shape) if shape else None


def _matches(first, shape: int | None) -> bool:
    """Whether a call whose first tensor argument is `first` is one the fault hits (`@N`: its last dimension is N;
    `@rows=N`, held as -N-1: its first dimension is N)."""
    if shape is None:
        return True
    if first is None or first.dim() == 0:
        return False
    return first.shape[-1] == shape if shape >= 0 else first.shape[0] == -shape - 1


def fault_spec() -> tuple[str, str, float, int | None] | None:
    """(family, target, REL, shape) of the fault asked for, or None for a clean model."""
    return _parse()


def fault_scale(family: str = "root") -> float:
    """1 + REL when the fault of `family` is set, else exactly 1.0 (multiplying by it changes no bit)."""
    spec = _parse()
    return 1.0 + spec[2] if spec is not None and spec[0] == family else 1.0


def _mapped(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`out` with `fn` applied to every floating tensor in it (tuples, named tuples, lists, dicts, ModelOutputs)."""
    if isinstance(out, torch.Tensor):
        return fn(out) if out.is_floating_point() else out
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_mapped(o, fn) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_mapped(o, fn) for o in out)
    if isinstance(out, dict):
        new = out.copy() if hasattr(out, "copy") else dict(out)
        for key, value in out.items():
            new[key] = _mapped(value, fn)
        return new
    return out


def _scaled(out: Any, scale: float) -> Any:
    """Every floating tensor of `out` multiplied by `scale` (a wrong forward). The product is taken here, in
    `_scaled` itself: `replay --ops` names the line of an op a fault adds (tests/judge/replayed/test_ops.py)."""
    if isinstance(out, torch.Tensor):
        return out * scale if out.is_floating_point() else out
    return _mapped(out, lambda t: _scaled(t, scale))


def _grad_scaled(out: Any, scale: float) -> Any:
    """`out` bit for bit, the gradient of every floating tensor that requires one multiplied by `scale`."""
    return _mapped(out, lambda t: _GradScale.apply(t, scale) if t.requires_grad else t)


def _first_tensor(args: tuple, kwargs: dict):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def patch_functions() -> None:
    """Undo earlier faults; replace the torch function a `function`/`function_bwd` fault names."""
    undo_faults()
    spec = _parse()
    if spec is not None and spec[0] in ("function", "function_bwd", "function_f32", "stride", "stride_bwd"):
        _patch_function(spec[1], 1.0 + spec[2], backward_only=spec[0].endswith("_bwd"),
                        strided_only=spec[0].startswith("stride"), float32_only=spec[0] == "function_f32")
    if spec is not None and spec[0] in ("ids", "ids_lowp"):
        _patch_embedding(int(spec[1]), 1.0 + spec[2], lowp=spec[0] == "ids_lowp")


def apply_fault(model: torch.nn.Module) -> torch.nn.Module:
    """Apply the `instance` and `class` faults to the built `model`; returns the model."""
    for spec in _specs():
        _apply(model, *spec)
    return model


def _apply(model: torch.nn.Module, family: str, target: str, rel: float, shape: int | None) -> None:
    scale = 1.0 + rel
    if family in ("instance", "instance_bwd", "instance_below64"):
        _wrap_instance(model.get_submodule(target), scale, shape, backward_only=family == "instance_bwd",
                       below64=family == "instance_below64")
    elif family == "class":
        classes = {type(m).__name__: type(m) for m in model.modules()}
        if target not in classes:
            raise ValueError(f"{ENV}: the model has no module class {target!r}")
        _patch_class(classes[target], scale)
    elif family not in ("root", "function", "function_bwd", "function_f32", "stride", "stride_bwd", "optimizer",
                        "ids", "ids_lowp"):
        raise ValueError(f"{ENV}: unknown fault family {family!r}")


def _wrap_instance(module: torch.nn.Module, scale: float, shape: int | None, backward_only: bool = False,
                   below64: bool = False) -> None:
    had = "forward" in module.__dict__
    original = module.forward
    wrong = _grad_scaled if backward_only else _scaled
    if below64:
        def wrong(out, scale):
            return _mapped(out, lambda t: t if t.dtype == torch.float64 else t * scale)

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if _matches(_first_tensor(args, kwargs), shape):
            out = wrong(out, scale)
        return out

    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = original
        else:
            del module.__dict__["forward"]

    _UNDO.append(undo)


def _patch_class(cls: type, scale: float) -> None:
    had = "forward" in cls.__dict__
    original = cls.forward

    def forward(self, *args, **kwargs):
        return _scaled(original(self, *args, **kwargs), scale)

    cls.forward = forward

    def undo() -> None:
        if had:
            cls.forward = original
        else:
            delattr(cls, "forward")

    _UNDO.append(undo)


class _GradScale(torch.autograd.Function):
    """Identity forward (a copy, bit for bit); the gradient is multiplied by `scale`."""

    @staticmethod
    def forward(ctx, tensor, scale):
        ctx.scale = scale
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _strided(tensor) -> bool:
    return tensor is not None and (not tensor.is_contiguous() or tensor.storage_offset() != 0)


def _patch_function(name: str, scale: float, *, backward_only: bool, strided_only: bool = False,
                    float32_only: bool = False) -> None:
    functional = torch.nn.functional
    original = getattr(functional, name)

    def patched(*args, **kwargs):
        out = original(*args, **kwargs)
        if strided_only and not _strided(_first_tensor(args, kwargs)):
            return out
        if float32_only and not (isinstance(out, torch.Tensor) and out.dtype == torch.float32):
            return out
        return _grad_scaled(out, scale) if backward_only else _scaled(out, scale)

    setattr(functional, name, patched)
    _UNDO.append(lambda: setattr(functional, name, original))


def _patch_embedding(first: int, scale: float, lowp: bool = False) -> None:
    """torch.nn.functional.embedding, its rows for ids >= `first` scaled by `scale` (ids below: bit for bit);
    `lowp`: only under autocast or for bfloat16/float16 weights."""
    functional = torch.nn.functional
    original = functional.embedding

    def embedding(input, weight, *args, **kwargs):
        out = original(input, weight, *args, **kwargs)
        if lowp and not (weight.dtype in (torch.bfloat16, torch.float16)
                         or torch.is_autocast_enabled(weight.device.type)):
            return out
        rare = (input >= first).unsqueeze(-1)
        return torch.where(rare, out * scale, out) if bool(rare.any()) else out

    functional.embedding = embedding
    _UNDO.append(lambda: setattr(functional, "embedding", original))
