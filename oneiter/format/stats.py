"""The statistics level (`record --level stats`): per tensor, a few float64 numbers and a checksum of its bytes.

A stats entry is a dataset of `len(FIELDS)` float64 values under the entry's usual name, with attributes `stats`
(true), `dtype` and `shape` (of the tensor it summarizes), `checksum` (two int64) and `checksum_kind`.
`tensor_stats` computes them where the tensor lives (reductions on the device, no host copy of the data);
`array_stats` computes the same numbers from a full entry, so a stats file compares with a full one. The
checksum is position dependent: on the CPU the CRC-32 of the tensor's bytes (`crc32`, with the element count);
on an accelerator, the bytes as signed integers of the element size, w, give `sum(w)` and `sum(w * (i mod
65521 + 1))`, wrapping in int64 (`sum64`). Equal checksums of one kind (with equal shape, dtype and statistics)
mean bitwise equal; a moved NaN or a flipped sign changes them.

How two stats entries are judged (`compare_stats`): equal checksums → bitwise equal, a match; otherwise the
relative error of the L2 norm and of the sum of |x| (each a lower bound of the elementwise relative L2 error,
by the triangle inequality) against the entry's rtol, and NaN/Inf counts. The elementwise error itself, and
local blame, need full data.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

__all__ = ["FIELDS", "tensor_stats", "array_stats", "compare_stats", "Stats"]

FIELDS = ("numel", "min", "max", "mean", "l2", "abs_sum", "nan", "inf")
_MOD = 65521
_CHUNK = 1 << 22
_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class Stats:
    """One entry's statistics: `values` (FIELDS order, float64), `checksum` (two ints) and its `kind`."""

    def __init__(self, values, checksum, kind: str = "crc32"):
        self.values = np.asarray(values, dtype=np.float64)
        self.checksum = tuple(int(c) for c in checksum)
        self.kind = kind

    def __getitem__(self, field: str) -> float:
        return float(self.values[FIELDS.index(field)])


def tensor_stats(tensor) -> Stats:
    """Statistics of a torch tensor, reduced where it lives; only a handful of numbers reach the host.

    Floating tensors are reduced in their own dtype or float32, whichever is wider (torch's cascade summation),
    integers and booleans in float64; NaN/Inf are counted only when the sum says there are any. On the CPU the
    checksum is the CRC-32 of the tensor's bytes (read in place, no copy); on an accelerator a position-weighted
    integer sum computed there (`sum64`)."""
    import torch

    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous()
    numel = t.numel()
    if numel == 0:
        return Stats([0, math.nan, math.nan, math.nan, 0.0, 0, 0, 0], (0, 0))
    x = t if t.is_floating_point() else t.to(torch.float64)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    total = x.sum(dtype=acc)
    nan = inf = None
    if not bool(torch.isfinite(total)):
        nan, inf = torch.isnan(x).sum(), torch.isinf(x).sum()
        x = x[torch.isfinite(x)]
    if x.numel():
        low, high = torch.aminmax(x)
        finite_sum = total if nan is None else x.sum(dtype=acc)  # one pass fewer when all values are finite
        parts = [low.to(acc), high.to(acc), finite_sum / x.numel(), torch.linalg.vector_norm(x, dtype=acc),
                 torch.linalg.vector_norm(x, ord=1, dtype=acc)]  # sum |x| without materializing |x|
        low, high, mean, l2, abs_sum = torch.stack(parts).tolist()
    else:
        low = high = mean = math.nan
        l2 = abs_sum = 0.0
    counts = (0, 0) if nan is None else (int(nan), int(inf))
    if t.device.type == "cpu":
        checksum, kind = (zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()), numel), "crc32"
    else:
        checksum, kind = _torch_checksum(t), "sum64"
    return Stats([numel, low, high, mean, l2, abs_sum, *counts], checksum, kind)


def _torch_checksum(t) -> tuple[int, int]:
    import torch

    size = t.element_size()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    words = t.contiguous().reshape(-1).view(ints)
    total = weighted = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64).remainder_(_MOD).add_(1)
        total += int(w.sum())
        weighted += int((w * pos).sum())
    return _wrap(total), _wrap(weighted)


def _wrap(value: int) -> int:
    """A Python int reduced to the int64 it wraps to (the checksum's sums wrap in int64 on every side)."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _numpy_checksum(data: np.ndarray) -> tuple[int, int]:
    """`sum64` of stored bytes, equal to `_torch_checksum` of the tensor they came from (bfloat16 is stored as
    uint16 bits and read here as int16, as the device reads it)."""
    if np.iscomplexobj(data):
        data = data.view(data.real.dtype)
    words = np.ascontiguousarray(data).reshape(-1).view(_INT_OF_SIZE[data.dtype.itemsize])
    total = weighted = 0
    for start in range(0, words.size, _CHUNK):
        w = words[start:start + _CHUNK].astype(np.int64)
        pos = np.arange(start, start + w.size, dtype=np.int64) % _MOD + 1
        with np.errstate(over="ignore"):
            total += int(w.sum())
            weighted += int((w * pos).sum())
    return _wrap(total), _wrap(weighted)


def array_stats(raw: np.ndarray, decoded: np.ndarray, kind: str = "crc32") -> Stats:
    """The same statistics from a full entry: `raw` as stored (bfloat16 as uint16 bits), `decoded` as numbers;
    `kind` picks the checksum to compute (the other side's)."""
    x = np.asarray(decoded)
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag], axis=-1)
    x = x.astype(np.float64, copy=False).reshape(-1)
    numel = x.size
    if numel == 0:
        return Stats([0, math.nan, math.nan, math.nan, 0.0, 0, 0, 0], (0, 0), kind)
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    finite = x if nan + inf == 0 else x[np.isfinite(x)]
    if finite.size:
        low, high, mean = float(finite.min()), float(finite.max()), float(finite.mean())
        l2, abs_sum = float(np.linalg.norm(finite)), float(np.abs(finite).sum())
    else:
        low = high = mean = math.nan
        l2 = abs_sum = 0.0
    data = np.ascontiguousarray(raw)
    checksum = (zlib.crc32(data.view(np.uint8)), numel) if kind == "crc32" else _numpy_checksum(data)
    return Stats([numel, low, high, mean, l2, abs_sum, nan, inf], checksum, kind)


def compare_stats(ref: Stats, tgt: Stats, *, rtol: float, atol: float):
    """Metrics of a pair judged from statistics (see the module docstring); `bitwise` says whether the checksums
    prove equality."""
    from oneiter.judge.metrics import Metrics

    numel = int(ref["numel"])
    counts = dict(num_nan_ref=int(ref["nan"]), num_inf_ref=int(ref["inf"]), num_nan_target=int(tgt["nan"]),
                  num_inf_target=int(tgt["inf"]))
    if ref.kind == tgt.kind and ref.checksum == tgt.checksum:  # the caller checked shape and dtype
        return Metrics(num_elements=numel, max_abs=0.0, max_rel=0.0, rel_l2=0.0, cosine=1.0, num_out=0,
                       frac_out=0.0, need_atol=0.0, need_rtol=0.0, **counts)
    rel = max(_rel(ref["l2"], tgt["l2"], atol * math.sqrt(max(numel, 1))),
              _rel(ref["abs_sum"], tgt["abs_sum"], atol * max(numel, 1)))
    out = 1 if rel > rtol else 0
    return Metrics(num_elements=numel, max_abs=math.nan, max_rel=math.nan, rel_l2=rel, cosine=math.nan,
                   num_out=out, frac_out=out / max(numel, 1), need_atol=math.nan, need_rtol=rel, **counts)


def _rel(ref: float, tgt: float, floor: float) -> float:
    if not (math.isfinite(ref) and math.isfinite(tgt)):
        return 0.0 if ref == tgt or (math.isnan(ref) and math.isnan(tgt)) else math.inf
    return abs(tgt - ref) / max(abs(ref), floor, 1e-300)
