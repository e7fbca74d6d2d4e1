"""The numbers of a local-error row: a rerun's tensor against its reference (`tensor_stats`, `rel_l2`).

Where this sits: the probes (`probe.py`) judge each rerun with these; the layer and op replays (`record/replay/`)
and the impact pass (`record/impact/`) use them too."""

from __future__ import annotations

import math

import torch

from oneiter.format.stats import pair_sums
from oneiter.runtime.sharding import shard_of

__all__ = ["tensor_stats", "rel_l2"]


def _pair(reference, value):
    """Both tensors flat on the CPU in one floating dtype: the wider of the two, at least float32 (float8 values,
    which torch promotes with nothing, read as float32 first: exactly)."""
    a, b = (_promotable(shard_of(t).detach().reshape(-1)) for t in (reference, value))  # never a tensor subclass
    work = torch.promote_types(a.dtype, b.dtype)
    if not work.is_floating_point or work in (torch.float16, torch.bfloat16):
        work = torch.float64 if not work.is_floating_point else torch.float32
    return a.to("cpu", work), b.to("cpu", work)


def _promotable(t):
    return t.float() if t.is_floating_point() and t.dtype.itemsize == 1 else t


def tensor_stats(reference, value) -> dict:
    """Local metrics of `value` against `reference`; NaN/Inf judged by position and sign.

    Computed in the wider of the two dtypes (float32 at least): differences of nearby floats are exact there.
    On the CPU the C kernel (`format.stats.pair_sums`) reads both once and sums in float64; elsewhere torch's
    reductions run, in the working dtype. A tensor holding NaN/Inf (or |x| near overflow) takes the careful path,
    in float64."""
    a, b = _pair(reference, value)
    sums = pair_sums(a, b)  # the C kernel: one pass, float64 sums
    dot: float | None
    max_abs: float | None
    if sums is not None:
        norm_a, norm_b, diff = (math.sqrt(s) for s in sums[:3])
        dot, max_abs = sums[3], sums[4]
    else:
        d = a - b
        norm_a, norm_b, diff = (torch.linalg.vector_norm(t).item() for t in (a, b, d))
        dot = max_abs = None
    counts = {"nan_ref": 0, "inf_ref": 0, "nan": 0, "inf": 0, "mismatch": 0}
    if not all(math.isfinite(x) for x in (norm_a, norm_b, diff)):
        return _careful_stats(a.double(), b.double())
    rel = diff / norm_a if norm_a else (0.0 if diff == 0 else math.inf)
    if diff == 0:
        cosine = 1.0
    elif norm_a and norm_b:
        dot = torch.dot(a, b).item() if dot is None else dot
        cosine = max(-1.0, min(1.0, dot / (norm_a * norm_b)))
    else:
        cosine = 0.0
    if not diff:
        max_abs = 0.0
    elif max_abs is None:
        max_abs = torch.linalg.vector_norm(d, ord=math.inf).item()
    return {"numel": int(a.numel()), "rel_l2": rel, "max_abs": max_abs, "cosine": cosine, **counts}


def _careful_stats(a, b) -> dict:
    """`tensor_stats` for tensors with NaN/Inf (or values whose squares overflow), in float64."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    both = fa & fb
    same = (a == b) | (nan_a & nan_b)  # +inf next to +inf, NaN next to NaN
    mismatch = int((~both & ~same).sum())
    numel = int(a.numel())
    a, b = a[both], b[both]
    d = a - b
    diff = torch.linalg.vector_norm(d).item()
    norm_a, norm_b = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item()
    rel = diff / norm_a if norm_a else (0.0 if diff == 0 else math.inf)
    cosine = 1.0 if diff == 0 else (max(-1.0, min(1.0, torch.dot(a, b).item() / (norm_a * norm_b)))
                                    if norm_a and norm_b else 0.0)
    return {
        "numel": numel, "rel_l2": rel, "max_abs": d.abs().max().item() if d.numel() else 0.0, "cosine": cosine,
        "nan_ref": int(nan_a.sum()), "inf_ref": int((~fa & ~nan_a).sum()), "nan": int(nan_b.sum()),
        "inf": int((~fb & ~nan_b).sum()), "mismatch": mismatch,
    }


def rel_l2(reference, value) -> float:
    """||value - reference|| / ||reference|| over the positions finite on both sides."""
    if tuple(reference.shape) != tuple(value.shape):
        return math.inf
    a, b = _pair(reference, value)
    sums = pair_sums(a, b)
    if sums is not None:
        norm, diff = math.sqrt(sums[0]), math.sqrt(sums[2])
    else:
        norm, diff = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(a - b).item()
    if not (math.isfinite(norm) and math.isfinite(diff)):
        a, b = a.double(), b.double()
        keep = torch.isfinite(a) & torch.isfinite(b)
        a, b = a[keep], b[keep]
        norm, diff = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(a - b).item()
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)
