"""Two `--level stats` entries judged from their statistics (`format.stats.Stats`), without tensor data.

How: equal checksums → bitwise equal, a match; otherwise the relative error of the L2 norm and of the sum of |x|
(each a lower bound of the elementwise relative L2 error, by the triangle inequality) against the entry's rtol,
and NaN/Inf counts. The elementwise error itself, and local blame, need full data. What the statistics are and
how they are computed is `oneiter.format.stats`; this module only compares them, so format never imports judge.
"""

from __future__ import annotations

import math

from oneiter.format.stats import Stats
from oneiter.judge.measure.metrics import Metrics

__all__ = ["compare_stats"]


def compare_stats(ref: Stats, tgt: Stats, *, rtol: float, atol: float) -> Metrics:
    """Metrics of a pair judged from statistics (see the module docstring); `bitwise` says whether the checksums
    prove equality."""
    numel = int(ref["numel"])
    counts = dict(num_nan_ref=int(ref["nan"]), num_inf_ref=int(ref["inf"]), num_nan_target=int(tgt["nan"]),
                  num_inf_target=int(tgt["inf"]))
    if ref.kind == tgt.kind and ref.checksum == tgt.checksum:  # the caller checked shape and dtype
        return Metrics(num_elements=numel, max_abs=0.0, max_rel=0.0, rel_l2=0.0, cosine=1.0, num_out=0,
                       frac_out=0.0, need_atol=0.0, need_rtol=0.0, **counts)
    rel = max(_relative_to_reference(ref["l2"], tgt["l2"], atol * math.sqrt(max(numel, 1))),
              _relative_to_reference(ref["abs_sum"], tgt["abs_sum"], atol * max(numel, 1)))
    out = 1 if rel > rtol else 0
    return Metrics(num_elements=numel, max_abs=math.nan, max_rel=math.nan, rel_l2=rel, cosine=math.nan,
                   num_out=out, frac_out=out / max(numel, 1), need_atol=math.nan, need_rtol=rel, **counts)


def _relative_to_reference(ref: float, tgt: float, floor: float) -> float:
    if not (math.isfinite(ref) and math.isfinite(tgt)):
        return 0.0 if ref == tgt or (math.isnan(ref) and math.isnan(tgt)) else math.inf
    return abs(tgt - ref) / max(abs(ref), floor, 1e-300)
