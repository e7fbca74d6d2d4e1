"""Reduced-precision modes of float32 matmuls and convolutions: what torch's flags say, and TF32 rounding.

A float32 run is not always float32 inside: cuDNN convolutions run TF32 by default
(`torch.backends.cudnn.conv.fp32_precision == "tf32"`), cuBLAS matmuls do when asked
(`torch.backends.cuda.matmul.fp32_precision = "tf32"`, or `torch.set_float32_matmul_precision("high")`), Ascend
has HF32 switches (`torch.npu.matmul.allow_hf32`, `torch.npu.conv.allow_hf32`), and oneDNN on the CPU has its own
(`torch.backends.mkldnn.matmul.fp32_precision`, `...conv.fp32_precision`). TF32 and HF32 keep 10 explicit mantissa
bits of each operand (products and sums stay float32); bf16 keeps 7.

`current(device_type)` reads the flags in force into a plain dict (the recording's root attribute
`precision_modes`, docs/format.md) and decides, from the flags *of the run's device type*, the mode of each op
family: `matmul` (aten mm, addmm, bmm, baddbmm, matmul, linear) and `conv` (convolution and its backward). Flags
are what torch was asked, not what the hardware did: a CPU without AMX or a GPU older than Ampere runs float32
whatever they say (for CUDA the compute capability is checked; for the CPU it cannot be, so the recorded mode is
the flag's). The local probes' calibration (`oneiter/record/local/reduced.py`) reruns the governed ops with their
float32 operands rounded by `round_mantissa`, so the expected noise holds the precision the run really had.

Which flags a device type reads is its row's `precision_flags` (`runtime/devices.py`: `cuda`, `mkldnn`, `npu`);
this module knows how to read each family of flags. A vendor plugin is never imported here: its flags are read
only when the program imported it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from oneiter.runtime.devices import DEVICE_TYPES, device_type

__all__ = ["FAMILIES", "MANTISSA_BITS", "FAMILY_OPS", "OPERANDS", "current", "read_settings", "modes_for", "reduced",
           "to_attr", "from_attr", "describe", "round_mantissa", "roundoff"]

FAMILIES = ("matmul", "conv")
MANTISSA_BITS = {"tf32": 10, "hf32": 10, "bf16": 7}  # explicit mantissa bits a reduced mode keeps (float32: 23)
FAMILY_OPS = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear"),
    "conv": ("convolution", "convolution_backward"),
}
# aten op name -> the positions of its operands (what TF32 hardware reads in reduced precision)
OPERANDS = {
    "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "linear": (0, 1),
    "addmm": (1, 2), "baddbmm": (1, 2),
    "convolution": (0, 1), "convolution_backward": (0, 1, 2),
}
IEEE = "ieee"

# the flags read, by the name a user sets them with; torch's getters of the new API hold "none" for "not set here"
_NEW_API = (
    "torch.backends.fp32_precision",
    "torch.backends.cuda.matmul.fp32_precision", "torch.backends.cudnn.fp32_precision",
    "torch.backends.cudnn.conv.fp32_precision", "torch.backends.cudnn.rnn.fp32_precision",
    "torch.backends.mkldnn.fp32_precision", "torch.backends.mkldnn.matmul.fp32_precision",
    "torch.backends.mkldnn.conv.fp32_precision",
)
_LEGACY = ("torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32")
# flags a vendor plugin adds to torch, by the `precision_flags` of the device types it registers
_PLUGIN_FLAGS = {"npu": ("torch.npu.matmul.allow_hf32", "torch.npu.conv.allow_hf32")}
# where each family's flag inherits from when it says "none", by `precision_flags`: the leaf first, the generic last
_CHAINS = {
    "cuda": {"matmul": ("torch.backends.cuda.matmul.fp32_precision", "torch.backends.cudnn.fp32_precision",
                        "torch.backends.fp32_precision"),
             "conv": ("torch.backends.cudnn.conv.fp32_precision", "torch.backends.cudnn.fp32_precision",
                      "torch.backends.fp32_precision")},
    "mkldnn": {"matmul": ("torch.backends.mkldnn.matmul.fp32_precision", "torch.backends.mkldnn.fp32_precision",
                       "torch.backends.fp32_precision"),
               "conv": ("torch.backends.mkldnn.conv.fp32_precision", "torch.backends.mkldnn.fp32_precision",
                        "torch.backends.fp32_precision")},
}


def _read(name: str) -> Any:
    """One flag by its dotted name: its value, None where this torch has no such flag, or the error text where
    the getter refuses (torch raises when the legacy and the new API were mixed)."""
    import torch

    obj: Any = torch
    try:
        for part in name.removeprefix("torch.").split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    except RuntimeError as err:
        return f"unreadable: {str(err).split(',')[0]}"
    return obj if isinstance(obj, (bool, str)) else str(obj)


def read_settings() -> dict[str, Any]:
    """Every reduced-precision flag this torch has, as it reads now (name -> value)."""
    import torch

    imported = {t.precision_flags for t in DEVICE_TYPES.values() if t.plugin in sys.modules}
    names = [*_NEW_API, *_LEGACY, *(f for flags, names in _PLUGIN_FLAGS.items() if flags in imported for f in names)]
    found = {name: _read(name) for name in names}
    try:
        found["torch.get_float32_matmul_precision()"] = torch.get_float32_matmul_precision()
    except RuntimeError as err:
        found["torch.get_float32_matmul_precision()"] = f"unreadable: {str(err).split(',')[0]}"
    return {k: v for k, v in found.items() if v is not None}


def _resolve(settings: dict[str, Any], chain: tuple[str, ...]) -> str | None:
    """The first value of `chain` that is set ("none": inherit from the next); None where torch has none of them."""
    values = [settings.get(name) for name in chain]
    if all(v is None for v in values):
        return None
    for value in values:
        if isinstance(value, str) and value not in ("none", "") and not value.startswith("unreadable"):
            return value
    return IEEE


def _legacy_cuda(settings: dict[str, Any], family: str) -> str:
    flag = settings.get("torch.backends.cuda.matmul.allow_tf32" if family == "matmul" else
                        "torch.backends.cudnn.allow_tf32")
    return "tf32" if flag is True else IEEE


def modes_for(type_name: str, settings: dict[str, Any]) -> dict[str, str]:
    """family -> mode (`ieee`, `tf32`, `hf32`, `bf16`) that the flags of device type `type_name` (its row's
    `precision_flags`) give float32 ops."""
    flags = device_type(type_name).precision_flags
    if flags == "npu":
        return {f: "hf32" if settings.get(f"torch.npu.{f}.allow_hf32") is True else IEEE for f in FAMILIES}
    chains = _CHAINS.get(flags) if flags is not None else None
    if chains is None:
        return dict.fromkeys(FAMILIES, IEEE)
    modes = {}
    for family, chain in chains.items():
        mode = _resolve(settings, chain)
        if mode is None:  # a torch without the fp32_precision API
            mode = _legacy_cuda(settings, family) if flags == "cuda" else IEEE
        modes[family] = mode
    return modes


def _cuda_without_tf32(flags: str | None) -> bool:
    """Whether the run's GPU has no TF32 (compute capability below 8.0): its float32 stays float32."""
    import torch

    if flags != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] < 8


def current(type_name: str) -> dict[str, Any]:
    """The modes in force for a run on device type `type_name`: {device_type, flags, matmul, conv, settings}."""
    settings = read_settings()
    modes = modes_for(type_name, settings)
    flags = device_type(type_name).precision_flags
    note = ""
    if _cuda_without_tf32(flags) and any(m == "tf32" for m in modes.values()):
        modes, note = dict.fromkeys(FAMILIES, IEEE), "the GPU has no TF32 (compute capability below 8.0)"
    out = {"device_type": type_name, "flags": f"{flags} flags" if flags else "", **modes, "settings": settings}
    if note:
        out["note"] = note
    return out


def reduced(modes: dict[str, Any] | None) -> dict[str, str]:
    """family -> mode for the families `modes` runs reduced (a mode `round_mantissa` reproduces)."""
    return {f: str(modes[f]) for f in FAMILIES if modes and str(modes.get(f)) in MANTISSA_BITS}


def roundoff(modes: dict[str, Any] | None) -> float:
    """The unit roundoff of the coarsest reduced mode in `modes` (TF32/HF32: 2^-11, bf16: 2^-8); 0.0 when float32
    ops run as float32."""
    return max((2.0 ** -(MANTISSA_BITS[m] + 1) for m in reduced(modes).values()), default=0.0)


def to_attr(modes: dict[str, Any]) -> str:
    return json.dumps(modes, sort_keys=True)


def from_attr(text: Any) -> dict[str, Any]:
    """The modes a recording holds; {} for a recording without them (made before they were recorded)."""
    if not isinstance(text, str) or not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def describe(modes: dict[str, Any]) -> str:
    """`matmul and conv in TF32 (cuda flags)`, or "" when nothing runs reduced."""
    red = reduced(modes)
    if not red:
        return ""
    by_mode: dict[str, list[str]] = {}
    for family, mode in red.items():
        by_mode.setdefault(mode, []).append(family)
    parts = [f"{' and '.join(fams)} in {mode.upper()}" for mode, fams in by_mode.items()]
    flags = modes.get("flags")
    return "; ".join(parts) + (f" ({flags})" if flags else "")


def round_mantissa(tensor, bits: int):
    """`tensor` (float32) with each value rounded to `bits` explicit mantissa bits, to nearest, ties to even (TF32
    and HF32: 10, bf16: 7), as float32. Done on the integer bits: add half a unit of the dropped part (plus the
    kept part's last bit, for ties to even) and clear the dropped bits. NaN and ±Inf pass unchanged; a value that
    rounds past the largest finite one becomes Inf, as the hardware's conversion does."""
    import torch

    if tensor.dtype != torch.float32 or bits >= 23:
        return tensor
    drop = 23 - bits
    ints = tensor.view(torch.int32)  # the same strides: a channels-last operand stays channels-last
    keep_lsb = (ints >> drop) & 1
    rounded = (ints + ((1 << (drop - 1)) - 1) + keep_lsb) & ~((1 << drop) - 1)
    special = (ints & 0x7F800000) == 0x7F800000  # NaN and Inf: their payload and sign stay as they are
    return torch.where(special, ints, rounded).view(torch.float32)
