"""Turn a `--model` spec into a ready-to-train bundle: a built-in name, or `path/to/file.py:function`.

The model contract (also in the README): the function takes `batch_size` and returns `(model, inputs, loss_fn)`,
`(model, inputs, loss_fn, make_optimizer)` or `(model, inputs, loss_fn, make_optimizer, batch)`:

- `model`: a `torch.nn.Module`;
- `inputs`: a tuple of tensors, called as `model(*inputs)` (a single tensor is accepted too);
- `loss_fn(output)`: returns a scalar tensor; it receives the output on the run's device;
- `make_optimizer(params)`: optional (None: `--optimizer`'s), builds the optimizer from `model.parameters()`;
- `batch(step)`: optional, `(inputs, loss_fn)` of iteration `step` (0-based), for runs of several iterations
  (`record --steps`, `--step`); it must depend on `step` alone (a replay of step S calls it without the steps
  before). Without it every iteration reuses `inputs` and `loss_fn`. With it, iteration 0 is `batch(0)` too.

The global torch RNG is seeded before the function runs, so weights and data it draws are reproducible.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from oneiter.errors import ModelError

__all__ = ["ModelBundle", "load_model", "parse_model_args", "is_file_spec", "canonical_spec"]


@dataclass
class ModelBundle:
    """What one training iteration needs. `name` is the spec the user gave (stored in the file)."""

    name: str
    model: Any
    inputs: tuple
    loss_fn: Callable
    make_optimizer: Callable | None = None
    batch: Callable | None = None  # batch(step) -> (inputs, loss_fn); None: every step is (inputs, loss_fn)

    def step_batch(self, step: int) -> tuple[tuple, Callable]:
        """(inputs, loss_fn) of iteration `step`: `batch(step)`, checked, or the bundle's own without it."""
        if self.batch is None:
            return self.inputs, self.loss_fn
        return _check_batch(self.name, step, self.batch(step))


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """`['image_size=64', 'num_layers=2']` -> `{'image_size': 64, 'num_layers': 2}` (ints, floats, bools, strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"--model-arg expects KEY=VALUE, got '{item}'")
        out[key.strip()] = _parse_scalar(value.strip())
    return out


def _parse_scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _load_function(spec: str) -> Callable:
    path_text, _, func_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ModelError(f"model file '{path}' does not exist (expected path/to/file.py:function)")
    module_name = f"oneiter_user_model_{abs(hash(str(path.resolve())))}"
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # so the file can import its neighbours (`from my_layers import Block`)
        sys.path.insert(0, folder)
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise ModelError(f"cannot import model file '{path}': not a Python file")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelError(f"importing '{path}' failed: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ModelError(f"'{path}' has no function '{func_name}'")
    return func


def _call_builder(func: Callable, batch_size: int, model_args: dict[str, Any]) -> Any:
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}
    if "batch_size" in params:
        return func(batch_size=batch_size, **model_args)
    return func(batch_size, **model_args)


def _validate(name: str, result: Any) -> ModelBundle:
    import torch

    if not isinstance(result, (tuple, list)) or len(result) not in (3, 4, 5):
        size = f" of {len(result)} items" if isinstance(result, (tuple, list)) else ""
        raise ModelError(f"model '{name}' must return (model, inputs, loss_fn[, make_optimizer[, batch]]), got "
                         f"{type(result).__name__}{size}")
    model, inputs, loss_fn = result[:3]
    make_optimizer = result[3] if len(result) >= 4 else None
    batch = result[4] if len(result) == 5 else None
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model '{name}': the first item must be a torch.nn.Module, got {type(model).__name__}")
    inputs, loss_fn = _check_inputs(name, "", inputs, loss_fn)
    if make_optimizer is not None and not callable(make_optimizer):
        raise ModelError(f"model '{name}': the fourth item must build the optimizer from the parameters (or be None)")
    if batch is not None and not callable(batch):
        raise ModelError(f"model '{name}': the fifth item must be batch(step) -> (inputs, loss_fn), got "
                         f"{type(batch).__name__}")
    return ModelBundle(name, model, inputs, loss_fn, make_optimizer, batch)


def _check_inputs(name: str, where: str, inputs: Any, loss_fn: Any) -> tuple[tuple, Callable]:
    """`inputs` as a tuple of tensors and a callable `loss_fn`, or a ModelError naming the model (and the step)."""
    import torch

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ModelError(f"model '{name}'{where}: inputs must be a tuple of tensors")
    if not callable(loss_fn):
        raise ModelError(f"model '{name}'{where}: loss_fn must be callable, got {type(loss_fn).__name__}")
    return tuple(inputs), loss_fn


def _check_batch(name: str, step: int, result: Any) -> tuple[tuple, Callable]:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ModelError(f"model '{name}': batch({step}) must return (inputs, loss_fn), got {type(result).__name__}")
    return _check_inputs(name, f" batch({step})", result[0], result[1])


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:function` rather than a built-in name."""
    return ":" in spec and spec.rpartition(":")[0].endswith(".py")


def canonical_spec(spec: str) -> str:
    """The spec as stored in a recording: a file spec with an absolute path (replay works from any folder)."""
    if not is_file_spec(spec):
        return spec
    path, _, func = spec.rpartition(":")
    return f"{Path(path).resolve()}:{func}"


def spec_for_replay(recorded: Any, given: str | None, source: str) -> str:
    """The model spec a replay of the recording `source` builds: `given` (what the user named) if any, else the
    recorded spec only when it is a built-in name. A recording is data, never code: a recorded model *file* runs
    only when the user names it."""
    if given:
        return given
    if not isinstance(recorded, str) or not recorded:
        raise ModelError(f"model must be named: '{source}' does not say which model it recorded", param="model")
    if is_file_spec(recorded):
        raise ModelError(f"model must be named: '{source}' was recorded from the model file '{recorded}', and a "
                         f"recording never chooses which code runs; name that file yourself to run it", param="model")
    from oneiter import models

    if recorded not in dict(models.list_models()):
        raise ModelError(f"model must be named: '{source}' records model '{recorded}', which is not a built-in "
                         f"model", param="model")
    return recorded


def load_model(spec: str, batch_size: int, seed: int = 0, model_args: dict[str, Any] | None = None) -> ModelBundle:
    """Build the model named by `spec` on the CPU with the torch RNG seeded by `seed`."""
    import torch

    if batch_size < 1:
        raise ModelError(f"--batch-size must be at least 1, got {batch_size}")
    model_args = model_args or {}
    if is_file_spec(spec):
        func = _load_function(spec)
    else:
        from oneiter import models

        func = models.get_builder(spec)
    torch.manual_seed(seed)
    try:
        result = _call_builder(func, batch_size, model_args)
    except TypeError as exc:
        raise ModelError(f"model '{spec}' rejected its arguments: {exc}") from exc
    return _validate(spec, result)
