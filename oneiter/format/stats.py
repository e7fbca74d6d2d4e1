"""The statistics level (`record --level stats`): per tensor, a few float64 numbers and a checksum of its bytes.

A stats entry is a row of the `/stats` table (docs/format.md) under the entry's usual name: `STATS_VALUES` as float64,
the tensor's dtype and shape, and a checksum. `tensor_stats` computes them where the tensor lives (reductions on
the device, no host copy of the data, a few numbers reach the host); `array_stats` computes the same numbers from
a full entry, so a stats file compares with a full one.

The checksum (`rowcol32`, the same on every device) is position dependent: the tensor's bytes, zero-padded, are
read as little-endian int32 words in rows of `ROW` (1024) words; the column sums `c_j` and the row sums `r_i`,
wrapping in int32, give `sum(c_j·(2j+1))` and `sum(r_i·(2i+1))`, wrapping in int64. One changed word always
changes both (odd weights: no wrap-around cancels them); other changes collide only by coincidence. Equal
checksums (with equal shape and dtype) are taken as bitwise equal; a moved NaN or a flipped sign changes them. It
costs two integer reductions of each chunk (`CHUNK` bytes) right after its statistics, while it is in cache.

Three paths compute the same numbers (tests hold each to the stored bytes): on an x86-64 CPU with AVX2, CPU
float32, float64 and bfloat16 tensors (and complex ones as their real pairs) go through the C kernel
`_statskernel.c`, built at install when a C compiler is there: one pass, one thread, sums in float64 (720 MB of
float32 in 0.11 s, 6.4 GB/s, against 0.20 s for the torch path on the same machine: `python
bench/bench_stats.py`). Any other tensor is reduced by torch where it lives, `CHUNK` bytes at a time; CPU tensors
of at most `SMALL` bytes that the kernel does not take are reduced with numpy (`array_stats`), which costs a tenth
of torch's per-op overhead.

The same kernel also judges a replay's reruns (`pair_sums`, used by `record/local/rerun.py`): the sums of a^2, b^2,
(a-b)^2 and a*b and max |a-b| of two CPU float32/float64 tensors in one pass over each, in float64 (a 6.4 MB
pair: 0.5 ms, against 3.3 ms for torch's five reductions and the difference tensor).

How two stats entries are judged is `oneiter.judge.measure.stat_metrics.compare_stats`.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from oneiter.format.schema import STATS_VALUES, decode, tensor_to_numpy

__all__ = ["CHECKSUM", "tensor_stats", "array_stats", "pair_sums", "Stats", "KERNEL"]

CHECKSUM = "rowcol32"
ROW = 1024  # int32 words per checksum row
CHUNK = 4 << 20  # bytes reduced at a time: a multiple of a row's bytes and of every element size; fits in cache
SMALL = 64 << 10  # CPU tensors of at most this many bytes are reduced with numpy (~40 us instead of ~150 us)
_EMPTY = [0, math.nan, math.nan, math.nan, 0.0, 0, 0, 0]
_LOCAL = threading.local()


class Stats:
    """One entry's statistics: `values` (`STATS_VALUES` order, float64), `checksum` (two ints) and its `kind`."""

    def __init__(self, values, checksum, kind: str = CHECKSUM):
        self.values = np.asarray(values, dtype=np.float64)
        self.checksum = tuple(int(c) for c in checksum)
        self.kind = kind

    def __getitem__(self, field: str) -> float:
        return float(self.values[STATS_VALUES.index(field)])


def tensor_stats(tensor) -> Stats:
    """Statistics of a torch tensor, reduced where it lives, `CHUNK` bytes at a time (each chunk is read from
    memory once: its statistics and its part of the checksum come from cache).

    Floating tensors are reduced in their own dtype or float32, whichever is wider (torch's cascade summation, per
    chunk; chunks add up in float64), integers and booleans in float64. NaN/Inf are counted only when the sum says
    there are any, in a second pass."""
    t = tensor.detach()
    if t.is_conj() or t.is_neg():  # lazy conjugate/negative views: the values, as a copy would hold them
        t = t.resolve_conj().resolve_neg()
    if t.device.type == "cpu" and KERNEL.use:
        found = _kernel_stats(t)
        if found is not None:
            return found
    if t.device.type == "cpu" and t.numel() * t.element_size() <= SMALL:  # numpy: a tenth of torch's op overhead
        raw, dtype = tensor_to_numpy(t.contiguous())
        return array_stats(raw, decode(raw, dtype))
    return _torch_stats(t)


def _torch_stats(t) -> Stats:
    """`tensor_stats` in torch ops, where the tensor lives: one stacked row of partial reductions per chunk, added
    up in float64 at the end."""
    import torch

    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return Stats(_EMPTY, (0, 0))
    words = flat.view(torch.uint8)
    if words.storage_offset() % 4:
        words = words.clone()  # int32 words must be aligned
    floating = flat.is_floating_point()
    acc = torch.float64 if flat.dtype == torch.float64 or not floating else torch.float32
    step = CHUNK // flat.element_size()  # a chunk's bytes are whole checksum rows
    scratch = (_scratch(flat.dtype, flat.device, min(step, numel)) if floating else  # integers: float64, not kept
               torch.empty(min(step, numel), dtype=torch.float64, device=flat.device))
    checksum = _Checksum(flat.device)
    size, parts = flat.element_size(), []
    for start in range(0, numel, step):
        x = flat[start:start + step]
        if not floating:
            x = x.to(torch.float64)
        low, high = torch.aminmax(x)
        abs_sum = torch.abs(x, out=scratch[:x.numel()]).sum(dtype=acc)  # |x| in a reused buffer, still in cache
        parts.append(torch.stack([x.sum(dtype=acc), low.to(acc), high.to(acc),
                                  torch.linalg.vector_norm(x, dtype=acc), abs_sum]))
        checksum.add(words[start * size:(start + x.numel()) * size], start * size)
    p = torch.stack(parts).to(torch.float64)
    total, low, high, l2, abs_sum = torch.stack([p[:, 0].sum(), p[:, 1].min(), p[:, 2].max(),
                                                 p[:, 3].square().sum().sqrt(), p[:, 4].sum()]).tolist()
    values = [numel, low, high, total / numel, l2, abs_sum, 0, 0]
    if not math.isfinite(total):  # NaN or Inf (or a float32 sum that overflowed): count, then finite values only
        values = _with_non_finite(flat)
    return Stats(values, checksum.value())


def _kernel_stats(t) -> Stats | None:
    """The C kernel's one pass (`_statskernel.c`) for a CPU float32, float64 or bfloat16 tensor (complex ones as
    their real pairs); None for any other, or when the kernel was not built."""
    import torch

    kernel, kinds = KERNEL.load()
    if kernel is None:
        return None
    if t.is_complex():
        t = torch.view_as_real(t)
    kind = kinds.get(t.dtype)
    if kind is None or t.numel() == 0:
        return None
    t = t.contiguous()
    numel = t.numel()
    low, high, total, sumsq, abs_sum, nan, inf, finite, *checksum = kernel.reduce(t.data_ptr(), numel, kind)
    return Stats(_values(numel, nan, inf, finite, low, high, total, math.sqrt(sumsq), abs_sum), checksum)


def _values(numel: int, nan: int, inf: int, finite: int = 0, low=0.0, high=0.0, total=0.0, l2=0.0,
            abs_sum=0.0) -> list:
    """A stats row (`STATS_VALUES` order) from reductions over the `finite` finite values; none finite: no min, max
    or mean."""
    if not finite:
        return [numel, math.nan, math.nan, math.nan, 0.0, 0.0, nan, inf]
    return [numel, low, high, total / finite, l2, abs_sum, nan, inf]


class _Kernel:
    """The optional C kernel, loaded on first use: built at install when a C compiler is there; without it (or
    with `use` False) CPU tensors are reduced like any other, with torch (numpy for small ones)."""

    def __init__(self) -> None:
        self.use = True
        self._loaded = None

    def load(self):
        """(the extension module, torch dtype -> its kind), or (None, {}) where it is not to be used."""
        if self._loaded is None:
            self._loaded = _load_kernel()
        return self._loaded

    @property
    def available(self) -> bool:
        return self.load()[0] is not None


def _load_kernel():
    import sys

    if sys.byteorder != "little":  # rowcol32 reads little-endian words; the kernel reads native ones
        return None, {}
    try:
        from oneiter.format import _statskernel
    except ImportError:  # not built (no C compiler at install)
        return None, {}
    if not _statskernel.simd():  # without its vectorized path (no AVX2: not x86-64) torch's reductions are faster
        return None, {}
    import torch

    return _statskernel, {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}


KERNEL = _Kernel()


def pair_sums(a, b) -> tuple[float, float, float, float, float] | None:
    """(sum a^2, sum b^2, sum (a-b)^2, sum a*b, max |a-b|) of two contiguous CPU tensors of one dtype (float32 or
    float64), accumulated in float64 by the C kernel in one pass over each; a NaN or Inf makes a total non-finite.
    None where the kernel does not apply (not built, switched off, another dtype or device): the caller reduces
    with torch. Judging a rerun against its reference (`record/local/rerun.py`) runs on this."""
    if not KERNEL.use or a.dtype != b.dtype or a.numel() != b.numel():
        return None
    kernel, kinds = KERNEL.load()
    kind = kinds.get(a.dtype)
    if kernel is None or kind not in (0, 1) or a.device.type != "cpu" or b.device.type != "cpu" \
            or not a.is_contiguous() or not b.is_contiguous():
        return None
    return kernel.pair(a.data_ptr(), b.data_ptr(), a.numel(), kind)


def _scratch(dtype, device, numel: int):
    """A buffer for |x|: on the CPU one per thread and dtype, kept (fresh pages cost more than the reduction)."""
    import torch

    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)  # the device's caching allocator reuses it
    kept = getattr(_LOCAL, "scratch", None)
    if kept is None:
        kept = _LOCAL.scratch = {}
    buf = kept.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = kept[dtype] = torch.empty(max(numel, CHUNK // dtype.itemsize), dtype=dtype)
    return buf


def _with_non_finite(flat) -> list:
    import torch

    x = flat if flat.is_floating_point() else flat.to(torch.float64)
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    x = x[finite]
    if not x.numel():
        return _values(flat.numel(), nan, inf)
    low, high = torch.aminmax(x)
    low, high, total, l2, abs_sum = torch.stack([low, high, x.sum(), torch.linalg.vector_norm(x),
                                                 x.abs().sum()]).tolist()
    return _values(flat.numel(), nan, inf, x.numel(), low, high, total, l2, abs_sum)


class _Checksum:
    """`rowcol32` of a tensor's bytes, fed in order, `CHUNK` bytes at a time (a multiple of a row's bytes)."""

    def __init__(self, device):
        import torch

        self.cols = torch.zeros(ROW, dtype=torch.int32, device=device)
        self.rows = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, data, offset: int) -> None:
        import torch

        full = data.numel() // (4 * ROW) * (4 * ROW)
        blocks = [data[:full]] if full else []
        if full < data.numel():  # the last, partial row: zero-padded
            tail = torch.zeros(4 * ROW, dtype=torch.uint8, device=data.device)
            tail[:data.numel() - full] = data[full:]
            blocks.append(tail)
        row = offset // (4 * ROW)
        for block in blocks:
            w = block.view(torch.int32).view(-1, ROW)
            self.cols.add_(w.sum(0, dtype=torch.int32))
            r = w.sum(1, dtype=torch.int32).to(torch.int64)
            odd = torch.arange(row, row + r.numel(), dtype=torch.int64, device=r.device).mul_(2).add_(1)
            self.rows.add_((r * odd).sum())
            row += r.numel()

    def value(self) -> tuple[int, int]:
        import torch

        odd = torch.arange(ROW, dtype=torch.int64, device=self.cols.device).mul_(2).add_(1)
        return tuple(torch.stack([(self.cols.to(torch.int64) * odd).sum(), self.rows]).tolist())


def _numpy_checksum(data: np.ndarray) -> tuple[int, int]:
    """`rowcol32` of stored bytes (bfloat16 stored as uint16 bits), equal to the device's for the same bytes."""
    b = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    full = b.size // (4 * ROW) * (4 * ROW)
    blocks = [b[:full].view(np.int32).reshape(-1, ROW)]
    if full < b.size:  # the last, partial row: zero-padded (a copy of that row only)
        tail = np.zeros(4 * ROW, np.uint8)
        tail[:b.size - full] = b[full:]
        blocks.append(tail.view(np.int32).reshape(1, ROW))
    with np.errstate(over="ignore"):
        cols = sum(w.sum(0, dtype=np.int32) for w in blocks).astype(np.int64)
        rows = np.concatenate([w.sum(1, dtype=np.int32) for w in blocks]).astype(np.int64)
        a = (cols * (np.arange(ROW, dtype=np.int64) * 2 + 1)).sum()
        c = (rows * (np.arange(rows.size, dtype=np.int64) * 2 + 1)).sum()
    return int(a), int(c)


def array_stats(raw: np.ndarray, decoded: np.ndarray) -> Stats:
    """The same statistics from a full entry: `raw` as stored (bfloat16 as uint16 bits), `decoded` as numbers."""
    x = np.asarray(decoded)
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag], axis=-1)
    x = x.astype(np.float64, copy=False).reshape(-1)
    numel = x.size
    if numel == 0:
        return Stats(_EMPTY, (0, 0))
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    finite = x if nan + inf == 0 else x[np.isfinite(x)]
    if finite.size:
        low, high, mean = float(finite.min()), float(finite.max()), float(finite.mean())
        l2, abs_sum = float(np.linalg.norm(finite)), float(np.abs(finite).sum())
    else:
        low = high = mean = math.nan
        l2 = abs_sum = 0.0
    return Stats([numel, low, high, mean, l2, abs_sum, nan, inf], _numpy_checksum(raw))
