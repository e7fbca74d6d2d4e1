"""Monte Carlo estimate of a precision's noise, for calls whose high-precision calibration run cannot run.

The calibration (`probe.py`) measures the noise of a precision as rel_l2(run in that precision, run in a higher
one). When the higher run fails — an op without a float64 kernel (`torch._grouped_mm` of MoE experts; many ops on
accelerators without float64) — the noise is estimated in the run's own precision instead: the call is rerun
`SAMPLES` times with every floating value it reads (inputs, forced children's outputs and gradients, the output
gradients, weights, buffers) perturbed at the precision's unit roundoff (`rerun.Perturbation`, a fixed seed per
sample), and the spread of the results around the unperturbed rerun, `SCALE` x RMS_k rel_l2(sample_k, base),
stands for the noise. A perturbation of one unit in the last place also reshuffles every rounding the rerun
makes, so the spread holds both the inputs' sensitivity and the rounding errors of the computation.

`SCALE` makes the estimate comparable to the float64-based one; it was measured on calls that have float64
(linear, conv, layer norm, softmax, silu, in float32 and bf16): `python bench/monte_carlo_noise.py`. A single aten
op (`replay/op_rerun.py`, `oneiter replay --ops`, where the CPU has no kernel in the op's dtypes) takes `OP_SCALE`
instead: each sample and the base carry their own rounding, so their difference is about sqrt(2) times one run's error.
"""

from __future__ import annotations

import math

from oneiter.record.local.rerun import rel_l2

__all__ = ["MONTE_CARLO", "SAMPLES", "SCALE", "OP_SCALE", "SEED", "BOUND_SAMPLES", "spread"]

MONTE_CARLO = "monte_carlo"  # the `calibration` suffix of a noise estimated this way (`cpu:monte_carlo`)
SAMPLES = 4  # perturbed reruns per estimate
SCALE = 0.5  # the RMS spread of the samples times this is comparable to the float64-based noise (measured)
OP_SCALE = 1 / math.sqrt(2)  # the same for one aten op: two independently rounded runs differ by ~sqrt(2) errors
SEED = 0x5EED  # sample k's perturbation comes from a generator seeded with SEED + k
# float64 reruns with a precision's rounding injected (`modes/roundoff_mode.py`) whose RMS spread is the bound a call's
# noise is checked against: within the check's factor 16, two samples are enough (the RMS of two is within 2x)
BOUND_SAMPLES = 2


def spread(base, samples: list, scale: float = SCALE) -> float:
    """`scale` x the RMS over the samples of rel_l2(sample, base)."""
    rels = [rel_l2(base, sample) for sample in samples]
    return scale * math.sqrt(sum(r * r for r in rels) / len(rels))
