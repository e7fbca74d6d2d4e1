"""Number formats as oneiter computes them itself: a float64 value rounded to a narrower floating format.

Where this sits: the emulation of a low-precision recipe (`emulate.py`) rounds the operands it quantizes (float8
elements, the float32 products of a scaling) and the results it produces (a bfloat16 intermediate, the module's
output dtype) with these functions, in float64 arithmetic of its own, never with a cast kernel of the target's (a
device's `aten::_to_copy` to float8 could be the very kernel under test).

`round_to(x, dtype)` rounds to nearest, ties to even, like IEEE casts and torch's: with the format's subnormals, and
at overflow saturating to the largest finite value (the float8 formats without infinities: torch's eager casts
saturate them since 2.12, torchao clamps before it casts) or going to infinity (IEEE formats: float16, bfloat16,
float32). Exact for every float64 input: the quantum of a value's binade is a power of two, so scaling by it and
rounding to an integer loses nothing.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["round_to", "spacing", "FLOAT8", "format_name"]

FLOAT8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
# (explicit mantissa bits, exponent of the smallest normal, largest finite value) of the float8 formats, written out:
# torch.finfo(torch.float8_e5m2fnuz).eps says 0.125 (3 mantissa bits) where the format has 2
_FLOAT8_SPECS = {"float8_e4m3fn": (3, -6, 448.0), "float8_e4m3fnuz": (3, -7, 240.0),
                 "float8_e5m2": (2, -14, 57344.0), "float8_e5m2fnuz": (2, -15, 57344.0)}
_SATURATING = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz")  # no infinities to overflow into


@lru_cache(maxsize=None)
def _spec(name: str) -> tuple[int, int, float, bool]:
    """(explicit mantissa bits, exponent of the smallest normal, largest finite value, saturating) of a format."""
    if name in _FLOAT8_SPECS:
        return (*_FLOAT8_SPECS[name], name in _SATURATING)
    info = torch.finfo(getattr(torch, name))
    return round(-math.log2(info.eps)), round(math.log2(info.tiny)), float(info.max), False


def format_name(dtype) -> str:
    """`float8_e4m3fn` for torch.float8_e4m3fn (and for the name itself)."""
    return str(dtype).removeprefix("torch.")


def spacing(x: torch.Tensor, dtype) -> torch.Tensor:
    """The distance between neighbouring values of `dtype` around each element of float64 `x` (its quantum)."""
    bits, emin, _, _ = _spec(format_name(dtype))
    _, exp = torch.frexp(x)
    binade = torch.clamp(exp.to(torch.float64) - 1, min=emin)  # floor(log2|x|), and the subnormals' binade
    return torch.exp2(binade - bits)


def round_to(x: torch.Tensor, dtype) -> torch.Tensor:
    """`x` (float64) rounded to `dtype`'s values, to nearest, ties to even; still float64 (module docstring)."""
    name = format_name(dtype)
    if name == "float64":
        return x
    _, _, largest, saturating = _spec(name)
    quantum = spacing(x, name)
    rounded = torch.round(x / quantum) * quantum  # torch.round: half to even
    over = rounded.abs() > largest
    if saturating:
        return torch.where(over, torch.copysign(torch.full_like(x, largest), x), rounded)
    return torch.where(over, torch.copysign(torch.full_like(x, math.inf), x), rounded)
