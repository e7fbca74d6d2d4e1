"""What training frameworks wrap around a model and its optimizer, and the objects inside.

Where this sits: `oneiter.Recorder` takes whatever a framework handed the user and records the objects inside, so a
loop passes `accelerator.prepare`'s results (or Lightning's, or mmengine's) straight in:

- a model wrapped for data parallelism (`DistributedDataParallel`, `DataParallel`: `.module`) or compiled
  (`torch.compile`'s `OptimizedModule`: `._orig_mod`) -> the module whose `named_modules()` names the recording
  (the Recorder keeps a compiled one: its compiled block, hooked from outside, `runtime/compiled.py`);
- an optimizer wrapper (accelerate's `AcceleratedOptimizer`, mmengine's `OptimWrapper`: `.optimizer`; Lightning's
  `LightningOptimizer`: `._optimizer`) or a learning-rate scheduler (torch's: `.optimizer`; accelerate's
  `AcceleratedScheduler`: `.optimizers`) -> the torch optimizer(s) that step;
- the GradScaler an `AcceleratedOptimizer` steps through under `mixed_precision="fp16"` -> `grad_scalers`;
- accelerate's mixed-precision forward (`Accelerator(mixed_precision="bf16")` replaces `model.forward` by an
  autocast of it whose outputs are then cast to float32, `ConvertOutputsToFp32`) -> `model_forward_cast`.

Nothing here imports a framework: each wrapper is known by the attribute it keeps its content in.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable

__all__ = ["unwrap_model", "unwrap_optimizers", "grad_scalers", "ForwardCast", "model_forward_cast",
           "compiled_wrapper"]

_MODEL_WRAPPERS = ("DistributedDataParallel", "DataParallel")
_OPTIMIZER_SLOTS = ("optimizer", "_optimizer")  # AcceleratedOptimizer / OptimWrapper / LRScheduler, LightningOptimizer


def unwrap_model(model, *, compiled: bool = True):
    """The module inside DDP / DataParallel / `torch.compile` wrappers (nested ones too), or `model` itself.
    `compiled=False` keeps a `torch.compile` wrapper: the Recorder hooks it from outside its compiled code and names
    its modules by their eager names (`runtime/compiled.py`)."""
    for _ in range(8):
        if type(model).__name__ in _MODEL_WRAPPERS and hasattr(model, "module"):
            model = model.module
        elif compiled and type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            break
    return model


def compiled_wrapper(module):
    """The `torch.compile` wrapper (`OptimizedModule`) around `module` that the program holds, or `module` itself when
    none holds it: what a framework calls when it compiled the model it hands its callbacks (the Hugging Face
    Trainer's `torch_compile=True`: accelerate keeps `torch.compile(model)` and calls it; the callbacks get `model`).
    Found among the objects that refer to `module` (the wrapper keeps it in its `_modules`), once per recording."""
    import gc

    # module <- the wrapper's `_modules` dict <- its instance dict <- the wrapper
    holders = [h for h in gc.get_referrers(module) if isinstance(h, dict) and h.get(_COMPILED) is module]
    for _ in range(2):
        for owner in (o for h in holders for o in gc.get_referrers(h)):
            if type(owner).__name__ == "OptimizedModule" and getattr(owner, _COMPILED, None) is module:
                return owner
        holders = [o for h in holders for o in gc.get_referrers(h) if isinstance(o, dict) and
                   any(v is h for v in o.values())]
    return module


_COMPILED = "_orig_mod"  # where torch.compile's wrapper keeps the module


def unwrap_optimizers(obj) -> list:
    """The torch optimizers in `obj`: an optimizer, a wrapper of one, a scheduler of one or several, or a list or
    tuple of those (each optimizer once, in order). What is none of these comes back as it is, for the caller to
    refuse by name."""
    found: list = []
    for item in obj if isinstance(obj, (list, tuple)) else [obj]:
        for opt in _optimizers_in(item, 0):
            if not any(opt is seen for seen in found):
                found.append(opt)
    return found


def _optimizers_in(obj, depth: int) -> list:
    if _steps_itself(obj) or depth > 4:
        return [obj]
    for slot in _OPTIMIZER_SLOTS:
        inner = getattr(obj, slot, None)
        if inner is not None and inner is not obj:
            return _optimizers_in(inner, depth + 1)
    inner = getattr(obj, "optimizers", None)  # accelerate's AcceleratedScheduler
    if isinstance(inner, (list, tuple)) and inner:
        return [opt for each in inner for opt in _optimizers_in(each, depth + 1)]
    return [obj]


def _steps_itself(obj) -> bool:
    """A torch optimizer that holds its own step hooks. accelerate's `AcceleratedOptimizer` is a subclass of
    `torch.optim.Optimizer` that never ran its `__init__`: it has the method but no hooks of its own, and steps the
    optimizer inside it. An optimizer that wraps another and is initialized itself (a Lookahead) is kept whole."""
    return hasattr(obj, "register_step_pre_hook") and hasattr(obj, "_optimizer_step_pre_hooks")


def grad_scalers(obj) -> list:
    """The enabled GradScalers that the optimizer wrappers in `obj` step through (accelerate's
    `AcceleratedOptimizer.scaler` under `mixed_precision="fp16"`): the loss their backward runs on is scaled."""
    found: list = []
    for item in obj if isinstance(obj, (list, tuple)) else [obj]:
        scaler = getattr(item, "scaler", None) if item is not None and not _steps_itself(item) else None
        if scaler is not None and hasattr(scaler, "get_scale") and scaler.is_enabled():
            found.append(scaler)
    return found[:1]  # one scaler scales the loss once


def accumulation_steps(obj) -> int:
    """How many microbatches the optimizer wrappers in `obj` accumulate gradients over before they step (accelerate's
    `AcceleratedOptimizer` under `gradient_accumulation_steps`, mmengine's `OptimWrapper(accumulative_counts=...)`);
    1 when none says."""
    for item in obj if isinstance(obj, (list, tuple)) else [obj]:
        state = getattr(item, "gradient_state", None)
        count = getattr(state, "num_steps", None) if state is not None else getattr(item, "_accumulative_counts", None)
        if isinstance(count, int) and count > 1:
            return count
    return 1


@dataclass
class ForwardCast:
    """accelerate's mixed-precision forward of one model: its autocast dtype and how to take the float32 cast off."""

    dtype: Any  # the autocast's torch dtype (None if it could not be read)
    device_type: str | None
    model: Any
    wrapped: Callable  # what `model.forward` is now (autocast, then the cast to float32)
    inner: Callable  # the autocast alone

    def uncast(self) -> Callable[[], None]:
        """Make `model.forward` the autocast alone (the model's own outputs, in the precision it computed them);
        returns what puts accelerate's forward back."""
        self.model.forward = self.inner
        return self.restore

    def restore(self) -> None:
        self.model.forward = self.wrapped


def model_forward_cast(model) -> ForwardCast | None:
    """accelerate's mixed-precision forward on `model` (None: there is none).

    Under `mixed_precision="bf16"`/`"fp16"` accelerate's `prepare` (and so the Trainer's `bf16=True`) sets
    `model.forward` to the model's forward under autocast, followed by `convert_to_fp32` of what it returns: module
    hooks then see float32 *copies* of the outputs, made after the model's own code returned them. A model that
    returns the loss and the logits it computed it from returns logits no gradient reaches (the loss used the
    originals), where a float32 run returns the very logits the loss used: the two recordings would not hold the same
    gradients. `ForwardCast.uncast` gives the autocast alone, for the recorded iteration."""
    forward = model.__dict__.get("forward")
    if forward is None:
        return None
    convert = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    inner = getattr(convert, "model_forward", None)  # accelerate's ConvertOutputsToFp32 keeps what it wraps here
    if type(convert).__name__ != "ConvertOutputsToFp32" or inner is None:
        return None
    autocast = _autocast_of(inner)
    return ForwardCast(
        dtype=getattr(autocast, "fast_dtype", None), device_type=getattr(autocast, "device", None), model=model,
        wrapped=forward, inner=MethodType(inner, model) if isinstance(forward, MethodType) else inner,
    )


def _autocast_of(fn):
    """The `torch.autocast` a function was decorated with (`torch.autocast(...)(fn)` keeps it in its closure)."""
    import torch

    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.autocast):
            return value
    return None
