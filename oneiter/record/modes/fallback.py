"""`--fallback REGEX[,REGEX]`: run the matching torch functions on the CPU in float32, to confirm a suspect op.

Where this sits: `recorder.py` (the Recorder) wraps a target iteration (forward and backward) in an `OpFallback`. It
follows DIPU's `DIPU_FORCE_FALLBACK_OPS_LIST` convention: comma-separated regexes, each matched against a whole op name
(`re.fullmatch`), so `convolution` or `conv.*`, not `conv`. Example: `--fallback convolution --amp bf16` makes every
conv layer compute in float32 on the CPU, so each conv's local error drops to float32 rounding; if the divergence
downstream goes away as well, the device's conv was the culprit.

Why a `TorchFunctionMode` and not a dispatch mode: autocast casts a conv's inputs to bfloat16 at the dispatcher,
*before* any `TorchDispatchMode` sees them, so a fallback there could only compute on already-rounded inputs. A
torch-function mode sees `F.conv2d(x, w)` with the inputs as the model holds them. For a match it turns autocast
off, converts floating tensors to CPU float32 (`.to()`, differentiable; float64 stays float64), calls the function,
and moves the outputs back to the original device *keeping float32*: rounding them back to bfloat16 would put the
error right back. Autograd casts the gradients back to each input's dtype and device on its own (`.to` backward).

A function matches when a pattern matches its own name (`conv2d`, `linear`, `matmul` for `x @ w`) or one of the
aten ops it lowers to, from the `LOWERS_TO` table (`conv2d` -> `convolution`), so DIPU-style aten names work.

Limits:
- matching happens at the outermost torch call: a torch Python function that calls others (e.g.
  `F.multi_head_attention_forward`) is matched as a whole (through its `LOWERS_TO` entry); its inner calls are not
  seen on their own;
- names carry no overload: DIPU-style `add.out` matches nothing, write `add`;
- views, metadata, conversions and hooks (`_NEVER`) never fall back, so `.*` only moves compute functions;
- an in-place function (`relu_`, `inplace=True`, `out=`) computes on a CPU copy and is copied back, in the
  original dtype;
- with the mode active, `nn.MultiheadAttention`'s fused inference fast path is skipped (training never uses it).
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from oneiter.errors import OneIterError
from oneiter.record.modes import trusted

__all__ = ["OpFallback", "parse_fallback", "compile_patterns", "op_names", "LOWERS_TO"]

_CONV = ("convolution", "_convolution")
_MM = ("matmul", "mm", "bmm")
_LINEAR = ("linear", "addmm", "mm", "matmul")
_SDPA = ("_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")

# torch function name -> aten ops it lowers to (the names DIPU's fallback list and profiler traces use)
LOWERS_TO: dict[str, tuple[str, ...]] = {
    **{name: _CONV for name in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                                "conv_transpose3d", "conv_tbc")},
    "linear": _LINEAR, "bilinear": ("bilinear", "_trilinear"),
    "matmul": _MM, "rmatmul": _MM, "mm": ("mm",), "bmm": ("bmm",), "einsum": ("bmm", "mm"),
    "addmm": ("addmm",), "baddbmm": ("baddbmm",), "addbmm": ("addbmm",),
    "layer_norm": ("native_layer_norm",), "rms_norm": ("_fused_rms_norm",),
    "batch_norm": ("native_batch_norm", "_native_batch_norm_legit"), "instance_norm": ("native_batch_norm",),
    "group_norm": ("native_group_norm",),
    "softmax": ("_softmax",), "log_softmax": ("_log_softmax",),
    "embedding": ("embedding",), "embedding_bag": ("_embedding_bag",),
    "scaled_dot_product_attention": _SDPA,
    "multi_head_attention_forward": (*_LINEAR, "bmm", "baddbmm", "_softmax", "scaled_dot_product_attention", *_SDPA),
    "cross_entropy": ("cross_entropy_loss", "_log_softmax", "nll_loss", "nll_loss_nd"),
    "max_pool2d": ("max_pool2d_with_indices",), "max_pool3d": ("max_pool3d_with_indices",),
    "adaptive_avg_pool2d": ("_adaptive_avg_pool2d",), "adaptive_avg_pool3d": ("_adaptive_avg_pool3d",),
    "interpolate": ("upsample_nearest2d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_nearest1d",
                    "upsample_linear1d", "upsample_nearest3d", "upsample_trilinear3d"),
}

# never moved to the CPU, whatever the pattern: views, metadata, conversions, hooks, autograd plumbing
_NEVER = frozenset({
    "__get__", "__set__", "__delete__", "__getitem__", "__setitem__", "__repr__", "__format__", "__len__",
    "__iter__", "__bool__", "__index__", "__hash__", "__reduce_ex__", "__deepcopy__", "__setstate__",
    "__contains__", "__array__", "to", "cpu", "cuda", "type", "type_as", "float", "half", "bfloat16", "double",
    "int", "long", "bool", "detach", "detach_", "requires_grad_", "register_hook", "retain_grad", "backward",
    "item", "tolist", "numpy", "data_ptr", "size", "dim", "numel", "stride", "storage_offset", "is_contiguous",
    "element_size", "view", "view_as", "reshape", "reshape_as", "as_strided", "expand", "expand_as", "t",
    "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "split", "chunk",
    "unbind", "contiguous", "clone", "copy_", "zero_", "fill_", "set_", "share_memory_", "pin_memory",
    "untyped_storage", "is_floating_point", "is_complex", "get_device", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_tensor", "empty_like", "zeros_like", "ones_like", "full_like",
})
_INPLACE_DUNDERS = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
                              "xor", "lshift", "rshift"})


def parse_fallback(text: str | Iterable[str] | None) -> list[str]:
    """`"convolution,addmm"` -> `["convolution", "addmm"]`; a list of such strings (repeated flags) works too.

    Each pattern is validated. Like DIPU's list, a pattern cannot contain a comma.
    """
    if not text:
        return []
    parts = [text] if isinstance(text, str) else list(text)
    patterns = [p.strip() for part in parts for p in part.split(",") if p.strip()]
    compile_patterns(patterns)
    return patterns


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise OneIterError(f"bad --fallback regex '{pattern}': {err}; expected a Python regex matching whole "
                               "op names, such as 'convolution' or 'conv.*'") from None
    return compiled


def _func_name(func) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def op_names(func) -> tuple[str, ...]:
    """The names a pattern is matched against: the function's own name, undundered, and `LOWERS_TO` entries."""
    name = _func_name(func)
    core = name[2:-2] if name.startswith("__") and name.endswith("__") else name
    if core != name and core.startswith("i") and core[1:] in _INPLACE_DUNDERS:
        core = core[1:] + "_"  # x @= w -> matmul_
    base = core.rstrip("_") or core
    names = dict.fromkeys((name, core, *LOWERS_TO.get(base, ())))
    return tuple(names)


def _is_inplace(func, kwargs: dict) -> bool:
    name = _func_name(func)
    if name.startswith("__"):
        return name.startswith("__i") and name[3:-2] in _INPLACE_DUNDERS
    return name.endswith("_") or kwargs.get("inplace") is True


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every leaf of nested tuples/lists/dicts, keeping the container types."""
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_map(v, fn) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)  # tuple, list, torch.return_types structseq
    return fn(obj)


def _leaves(obj: Any) -> list:
    found: list = []
    _map(obj, found.append)
    return found


def _to_cpu_float32(value):
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.to("cpu", torch.float64 if value.dtype == torch.float64 else torch.float32)
    return value.to("cpu")


def _autocast_off(device_types: Iterable[str]) -> ExitStack:
    stack = ExitStack()
    for device_type in sorted(set(device_types)):
        if torch.amp.is_autocast_available(device_type):
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
    return stack


class OpFallback(TorchFunctionMode):
    """Runs torch functions whose names match `patterns` on the CPU in float32; `counts` per function name."""

    def __init__(self, patterns: Iterable[str]):
        super().__init__()
        self.patterns = list(patterns)
        self._compiled = compile_patterns(self.patterns)
        self.counts: dict[str, int] = {}
        self._decided: dict[tuple[str, ...], bool] = {}

    def matches(self, func) -> bool:
        names = op_names(func)
        if names[0] in _NEVER:
            return False
        hit = self._decided.get(names)
        if hit is None:
            hit = self._decided[names] = any(p.fullmatch(n) for p in self._compiled for n in names)
        return hit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._compiled or trusted.active() or not self.matches(func):
            return func(*args, **kwargs)
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(t.is_floating_point() for t in tensors):
            return func(*args, **kwargs)  # nothing to compute in float32 (index ops, int buffers)
        device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        cpu_args, cpu_kwargs = _map((tuple(args), kwargs), _to_cpu_float32)
        with _autocast_off({"cpu", *(t.device.type for t in tensors)}):
            result = func(*cpu_args, **cpu_kwargs)
        name = _func_name(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        if kwargs.get("out") is not None or (args and _is_inplace(func, kwargs)):
            return _copy_back(args, kwargs, cpu_args, cpu_kwargs)
        return _map(result, lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)


def _copy_back(args: tuple, kwargs: dict, cpu_args: tuple, cpu_kwargs: dict):
    """An in-place or `out=` call ran on CPU copies: write them back into the caller's tensors."""
    if kwargs.get("out") is not None:
        for live, copy in zip(_leaves(kwargs["out"]), _leaves(cpu_kwargs["out"]), strict=True):
            if live is not copy:
                live.copy_(copy)
        return kwargs["out"]
    if args[0] is not cpu_args[0]:
        args[0].copy_(cpu_args[0])
    return args[0]
