"""What a Recorder is given, read: the module it names, the torch optimizers inside their wrappers, the model's
device and dtypes, and the autocast a wrapped forward enters (`runtime/wrappers.py` unwraps them)."""

from __future__ import annotations

from dataclasses import replace

from oneiter.errors import OneIterError
from oneiter.record.options import RecordOptions, amp_name
from oneiter.runtime.precision import AMP_DTYPES
from oneiter.runtime.wrappers import unwrap_model, unwrap_optimizers

__all__ = ["model_of", "optimizer_list", "optimizer_names", "forward_autocast", "device_of", "param_dtype",
           "amp_dtype"]


def model_of(model):
    """The module a recording names: `model` itself, or the one inside a DDP / DataParallel wrapper
    (`runtime/wrappers.py`; the wrapper is still what the loop calls). A `torch.compile` wrapper is kept: it is the
    compiled block, hooked from outside its compiled code, its modules named by their eager names."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise OneIterError(f"model must be a torch.nn.Module, got {type(model).__name__}", param="model")
    return unwrap_model(model, compiled=False)


def optimizer_list(optimizer) -> list:
    """The torch optimizers of `optimizer`: one, a list, or what frameworks wrap them in (accelerate's
    `AcceleratedOptimizer`, Lightning's `LightningOptimizer`, mmengine's `OptimWrapper`) or step them with (an LR
    scheduler: its optimizer), each unwrapped (`runtime/wrappers.py`)."""
    if optimizer is None:
        return []
    items = unwrap_optimizers(optimizer)
    for item in items:
        if not hasattr(item, "register_step_pre_hook"):
            raise OneIterError(f"optimizer must be a torch.optim.Optimizer, a wrapper of one (accelerate's "
                               f"AcceleratedOptimizer, ...) or its LR scheduler, or a list of them; got "
                               f"{type(item).__name__}", param="optimizer")
    return items


def optimizer_names(optimizers) -> str:
    return ",".join(type(o).__name__.lower() for o in optimizers)


def forward_autocast(options: RecordOptions, cast) -> RecordOptions:
    """accelerate's mixed-precision forward enters its own autocast: the recording's `amp` is its dtype, and the
    Recorder does not enter another."""
    amp = amp_name(str(cast.dtype)) if cast.dtype is not None else None
    if options.amp is not None and amp is not None and options.amp != amp:
        raise OneIterError(f"amp is {options.amp!r}, but the model's forward (accelerate's mixed precision) autocasts "
                           f"to {AMP_DTYPES[amp]}: give amp={amp!r}, or leave amp out", param="amp")
    return replace(options, amp=options.amp or amp, manage_autocast=False)


def device_of(model):
    import torch

    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def param_dtype(model):
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def amp_dtype(amp: str | None):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")
