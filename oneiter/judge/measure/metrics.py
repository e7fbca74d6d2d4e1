"""Per-entry error metrics: how far a target tensor is from its reference, in numbers a verdict can rest on.

Sits under the engine (`engine.py` reads two tensors and calls `compare_arrays`) and beside `format/inspection.py`
(the one-tensor statistics of `oneiter inspect`, which shares `format/numbers.py` with it). Pure numpy; every
reduction is done in float64, chunk by chunk, so large tensors never need a full float64 copy and results do not
drift with reduction order.

With `a` the reference and `b` the target, over positions where both are finite:

- ``max_abs``   max |a - b|
- ``max_rel``   max |a - b| / max(|a|, |b|, floor), floor = 1e-3 * max|a| (or the smallest normal float64 when `a`
  is all zero). Symmetric and floored, so it stays between 0 and 2 and means something near zero: an element of
  1e-9 next to elements of 1 cannot produce a relative error of 1e6 (the failure of msprobe's mean relative error).
- ``rel_l2``    ||a - b|| / ||a||: the headline relative error, measured against the tensor's norm (0/0 = 0,
  x/0 = inf).
- ``cosine``    <a, b> / (||a|| ||b||); 1 when both are zero, 0 when only one is.
- ``frac_out``  share of elements with |a - b| > atol + rtol * |a|, or whose non-finiteness differs (NaN vs a
  number, +Inf vs -Inf, ...). NaN next to NaN and Inf next to the same Inf count as equal.
- ``need_atol`` the smallest atol that passes every finite element with the given rtol: max(|a-b| - rtol|a|, 0).
- ``need_rtol`` the smallest rtol that passes with the given atol: max((|a-b| - atol) / |a|, 0) over |a| > 0;
  inf when an element with a == 0 is off by more than atol (no rtol can pass it).
- ``num_nan_ref``, ``num_inf_ref``, ``num_nan_target``, ``num_inf_target``: NaN and ±Inf counts on each side.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from oneiter.format.numbers import CHUNK, dot, flat_numbers

__all__ = ["Metrics", "compare_arrays"]


@dataclass(frozen=True)
class Metrics:
    """The numbers of one reference/target pair; see the module docstring for the definitions."""

    num_elements: int
    max_abs: float
    max_rel: float
    rel_l2: float
    cosine: float
    num_out: int
    frac_out: float
    need_atol: float
    need_rtol: float
    num_nan_ref: int
    num_inf_ref: int
    num_nan_target: int
    num_inf_target: int

    @property
    def nonfinite_differs(self) -> bool:
        return (self.num_nan_ref, self.num_inf_ref) != (self.num_nan_target, self.num_inf_target)

    @property
    def diverged(self) -> bool:
        """Outside tolerance somewhere, or a different number of NaN/Inf."""
        return self.num_out > 0 or self.nonfinite_differs

    def as_dict(self) -> dict:
        return asdict(self)


def _abs_max_finite(flat: np.ndarray) -> float:
    if flat.size == 0:
        return 0.0
    top = max(float(flat.max()), -float(flat.min()))  # two passes, no temporary
    if np.isfinite(top):
        return top
    finite = flat[np.isfinite(flat)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


class _Accumulator:
    """Running sums and maxima over chunks, computed in four reused float64 buffers (no allocation per chunk)."""

    def __init__(self, atol: float, rtol: float, floor: float, chunk: int):
        self.atol, self.rtol, self.floor = atol, rtol, floor
        self.buffers = np.empty((4, chunk), dtype=np.float64)
        self.max_abs = self.max_rel = self.need_atol = self.need_rtol = 0.0
        self.sum_d2 = self.sum_a2 = self.sum_b2 = self.sum_ab = 0.0
        self.num_out = self.nan_a = self.inf_a = self.nan_b = self.inf_b = 0

    def add(self, a_part: np.ndarray, b_part: np.ndarray) -> None:
        """One chunk of both sides (any float dtype); the stored arrays are only read."""
        n = a_part.size
        a, b, d, t = (buf[:n] for buf in self.buffers)
        np.copyto(a, a_part)
        np.copyto(b, b_part)
        sum_a2, sum_b2 = dot(a, a), dot(b, b)
        if not math.isfinite(sum_a2 + sum_b2):  # a NaN/Inf somewhere (or |x| > 1e154): take the careful path
            self._drop_nonfinite(a, b)
            sum_a2, sum_b2 = dot(a, a), dot(b, b)
        self.sum_a2 += sum_a2
        self.sum_b2 += sum_b2
        self.sum_ab += dot(a, b)
        np.subtract(a, b, out=d)
        np.abs(d, out=d)
        self.sum_d2 += dot(d, d)
        d_max = float(d.max(initial=0.0))
        self.max_abs = max(self.max_abs, d_max)
        np.abs(a, out=a)
        np.abs(b, out=b)
        np.maximum(a, b, out=t)
        np.maximum(t, self.floor, out=t)
        np.divide(d, t, out=t)
        self.max_rel = max(self.max_rel, float(t.max(initial=0.0)))
        np.multiply(a, self.rtol, out=t)
        np.subtract(d, t, out=t)  # |a-b| - rtol|a|: over atol means outside tolerance
        self.need_atol = max(self.need_atol, float(t.max(initial=0.0)))
        if d_max > self.atol:  # otherwise nothing is out and need_rtol stays 0
            self.num_out += int(np.count_nonzero(t > self.atol))
            np.subtract(d, self.atol, out=t)
            with np.errstate(divide="ignore", invalid="ignore"):
                # x/0 = inf: an element with a == 0 off by more than atol, which no rtol can pass; 0/0 = nan: ignored
                np.divide(t, a, out=t)
            self.need_rtol = max(self.need_rtol, float(np.fmax.reduce(t)))

    def _drop_nonfinite(self, a: np.ndarray, b: np.ndarray) -> None:
        """Count NaN/Inf on each side, count positions where they disagree, then zero them in both chunks."""
        fa, fb = np.isfinite(a), np.isfinite(b)
        na, nb = np.isnan(a), np.isnan(b)
        self.nan_a += int(np.count_nonzero(na))
        self.nan_b += int(np.count_nonzero(nb))
        self.inf_a += int(np.count_nonzero(~fa & ~na))
        self.inf_b += int(np.count_nonzero(~fb & ~nb))
        pos = ~(fa & fb)
        same = (a[pos] == b[pos]) | (na[pos] & nb[pos])  # inf == inf, nan "==" nan
        self.num_out += int(np.count_nonzero(~same))
        a[pos] = 0.0  # judged above; the value metrics see finite pairs only
        b[pos] = 0.0

    def result(self, num_elements: int) -> Metrics:
        norm_a, norm_b = math.sqrt(self.sum_a2), math.sqrt(self.sum_b2)
        norm_d = math.sqrt(self.sum_d2)
        if norm_a > 0:
            rel_l2 = norm_d / norm_a
        else:
            rel_l2 = 0.0 if norm_d == 0 else math.inf
        if norm_a > 0 and norm_b > 0:
            cosine = min(max(self.sum_ab / (norm_a * norm_b), -1.0), 1.0)
        else:
            cosine = 1.0 if norm_a == norm_b else 0.0
        return Metrics(
            num_elements=num_elements, max_abs=self.max_abs, max_rel=self.max_rel, rel_l2=rel_l2, cosine=cosine,
            num_out=self.num_out, frac_out=self.num_out / num_elements if num_elements else 0.0,
            need_atol=max(self.need_atol, 0.0), need_rtol=max(self.need_rtol, 0.0),
            num_nan_ref=self.nan_a, num_inf_ref=self.inf_a, num_nan_target=self.nan_b, num_inf_target=self.inf_b,
        )


def _identical(a: np.ndarray, b: np.ndarray, num_elements: int) -> Metrics | None:
    """Fast path for bitwise-equal, all-finite tensors (repeat runs on one device): two cheap passes."""
    if a.dtype != b.dtype or a.dtype.kind != "f" or not np.array_equal(a, b):
        return None  # array_equal is False as soon as there is a NaN: those take the full path
    if not np.isfinite(a).all():
        return None
    return _equal(num_elements)


def compare_arrays(ref: np.ndarray, target: np.ndarray, *, atol: float, rtol: float, chunk: int = CHUNK) -> Metrics:
    """All metrics of `target` against `ref` (same number of elements), judged with `atol` and `rtol`.

    Integers and booleans are judged exactly: an element is out when it differs at all (float64 cannot tell 2**60
    from 2**60 + 1); the other metrics are still computed in float64 to show how far off they are."""
    if np.asarray(ref).dtype.kind in "iub" and np.asarray(target).dtype.kind in "iub":
        return _compare_integers(np.asarray(ref).reshape(-1), np.asarray(target).reshape(-1), chunk)
    a, b = flat_numbers(ref), flat_numbers(target)
    if a.size != b.size:
        raise ValueError(f"compare_arrays needs equal sizes, got {a.size} and {b.size}")
    fast = _identical(a, b, a.size)
    if fast is not None:
        return fast
    top = _abs_max_finite(a)
    floor = 1e-3 * top if top > 0 else float(np.finfo(np.float64).tiny)
    acc = _Accumulator(atol, rtol, floor, min(chunk, max(a.size, 1)))
    for start in range(0, a.size, chunk):
        acc.add(a[start:start + chunk], b[start:start + chunk])
    return acc.result(a.size)


def _compare_integers(a: np.ndarray, b: np.ndarray, chunk: int) -> Metrics:
    if a.size != b.size:
        raise ValueError(f"compare_arrays needs equal sizes, got {a.size} and {b.size}")
    differ = 0
    for start in range(0, a.size, chunk):
        pa, pb = a[start:start + chunk], b[start:start + chunk]
        if pa.dtype.kind == "b" or pb.dtype.kind == "b":
            pa, pb = pa.astype(np.int8), pb.astype(np.int8)
        differ += int(np.count_nonzero(pa != pb))  # numpy compares int64 with uint64 exactly (no float detour)
    if differ == 0:
        return _equal(a.size)
    shown = compare_arrays(a.astype(np.float64), b.astype(np.float64), atol=0.0, rtol=0.0, chunk=chunk)
    need = 1.0 if shown.max_abs == 0 else shown.need_atol  # apart by less than float64 resolves
    return Metrics(num_elements=a.size, max_abs=max(shown.max_abs, 1.0), max_rel=shown.max_rel, rel_l2=shown.rel_l2,
                   cosine=shown.cosine, num_out=differ, frac_out=differ / a.size, need_atol=need, need_rtol=math.inf,
                   num_nan_ref=0, num_inf_ref=0, num_nan_target=0, num_inf_target=0)


def _equal(num_elements: int) -> Metrics:
    """The metrics of two bitwise-equal, all-finite tensors."""
    return Metrics(num_elements=num_elements, max_abs=0.0, max_rel=0.0, rel_l2=0.0, cosine=1.0, num_out=0,
                   frac_out=0.0, need_atol=0.0, need_rtol=0.0, num_nan_ref=0, num_inf_ref=0, num_nan_target=0,
                   num_inf_target=0)
