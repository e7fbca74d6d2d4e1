"""Tolerances for `oneiter compare`: which (atol, rtol) an entry is judged with.

Sits between the engine (which asks, once per entry, "what tolerance applies here?") and the metrics (which only
take two numbers). The defaults are torch.testing.assert_close's, the convention PyTorch users already know:

    dtype       rtol      atol
    float64     1e-7      1e-7
    float32     1.3e-6    1e-5
    float16     1e-3      1e-5
    bfloat16    1.6e-2    1e-5
    integers, bool: exact (0, 0)

An element passes when ``|a - b| <= atol + rtol * |a|`` (a = reference), as in assert_close.

A policy is any callable ``policy(entry, dtype) -> Tolerance`` (a `Tolerance` unpacks as ``atol, rtol``). Today's
policy is `DtypeTolerance` (dtype defaults, `--atol`/`--rtol` overrides); a tolerance file's per-module policy
(`tolerance_file.FileTolerance`) plugs in at the same place.

What blame tolerates of a call's *own* error is `NoisePolicy`: how many times its expected noise it may reach
(`judge/iteration/blame.py` measures it against this).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

from oneiter.errors import OneIterError
from oneiter.format.layout import Entry
from oneiter.runtime.precision import FLAG_FACTOR, unit_roundoff

__all__ = ["Tolerance", "TolerancePolicy", "DtypeTolerance", "DTYPE_DEFAULTS", "default_tolerance", "looser",
           "NoisePolicy"]

# dtype name -> (atol, rtol); torch.testing.assert_close's defaults. float8 gets one ulp of its mantissa.
DTYPE_DEFAULTS: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-5, 1.3e-6),
    "float16": (1e-5, 1e-3),
    "bfloat16": (1e-5, 1.6e-2),
    "complex128": (1e-7, 1e-7),
    "complex64": (1e-5, 1.3e-6),
    "float8_e4m3fn": (1e-5, 0.125),
    "float8_e4m3fnuz": (1e-5, 0.125),
    "float8_e5m2": (1e-5, 0.25),
    "float8_e5m2fnuz": (1e-5, 0.25),
}
_EXACT = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")


@dataclass(frozen=True)
class Tolerance:
    """The tolerance one entry is judged with."""

    atol: float
    """Absolute tolerance."""
    rtol: float
    """Relative tolerance, relative to the reference value."""
    source: str = "default"
    """Where it comes from, for reports: `float32 default`, `--atol/--rtol`, ..."""

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0):  # also rejects NaN
            raise OneIterError(f"tolerances must be >= 0, got atol={self.atol} rtol={self.rtol}")

    def __iter__(self) -> Iterator[float]:
        """`atol, rtol = tolerance`."""
        return iter((self.atol, self.rtol))


class TolerancePolicy(Protocol):
    """What the engine calls for every entry: the tolerance of `entry` stored as `dtype` (a torch dtype name)."""

    def __call__(self, entry: Entry, dtype: str) -> Tolerance: ...


def default_tolerance(dtype: str) -> Tolerance:
    """assert_close's tolerance for a torch dtype name; integers and bool are compared exactly."""
    if dtype in DTYPE_DEFAULTS:
        atol, rtol = DTYPE_DEFAULTS[dtype]
        return Tolerance(atol, rtol, f"{dtype} default")
    if dtype in _EXACT:
        return Tolerance(0.0, 0.0, f"{dtype} exact")
    # an unknown floating type: the float32 convention is the least surprising choice
    atol, rtol = DTYPE_DEFAULTS["float32"]
    return Tolerance(atol, rtol, f"{dtype}: float32 default")


def looser(first: Tolerance, second: Tolerance) -> Tolerance:
    """The tolerance of the lower-precision side, for runs made in different dtypes on purpose."""
    if (first.rtol, first.atol) >= (second.rtol, second.atol):
        return first
    return second


class DtypeTolerance:
    """dtype defaults, with `--atol` / `--rtol` replacing either number for every entry."""

    def __init__(self, *, atol: Optional[float] = None, rtol: Optional[float] = None):
        for name, value in (("--atol", atol), ("--rtol", rtol)):
            if value is not None and not value >= 0:
                raise OneIterError(f"{name} must be >= 0, got {value}")
        self.atol = atol
        self.rtol = rtol

    def __call__(self, entry: Entry, dtype: str) -> Tolerance:
        base = default_tolerance(dtype)
        if self.atol is None and self.rtol is None:
            return base
        atol = base.atol if self.atol is None else self.atol
        rtol = base.rtol if self.rtol is None else self.rtol
        given = " ".join(n for n, v in (("--atol", self.atol), ("--rtol", self.rtol)) if v is not None)
        return Tolerance(atol, rtol, given)


@dataclass
class NoisePolicy:
    """How far above its expected noise a layer's local error may go (per-module overrides from a tolerance file)."""

    factor: float = FLAG_FACTOR
    """A layer is flagged when local rel-L2 > factor x expected noise."""
    floor_ulps: float = 1.0
    """The expected noise is at least this many unit roundoffs of the tensor's dtype."""
    overrides: list[tuple[str, float]] = field(default_factory=list)
    """(module glob, factor) pairs; the last matching one wins."""
    skip: list[str] = field(default_factory=list)
    """Module globs never flagged (their local error is still shown)."""

    def factor_for(self, module: str) -> float:
        factor = self.factor
        for pattern, value in self.overrides:
            if fnmatch.fnmatchcase(module, pattern):
                factor = value
        return factor

    def skipped(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, pattern) for pattern in self.skip)

    def floor(self, dtype: str) -> float:
        return self.floor_ulps * unit_roundoff(dtype)
