"""The noise of every tensor of a rerun, from other reruns: against a high-precision run (`rel_all`), as the
spread of Monte Carlo samples (`spread_all`), the tensors a rounding injection overflowed (`overflowed`), and the
unit roundoff a run computes in (`roundoff_of`). Where this sits: the calibration and its bound (`calibration.py`,
`bounds.py`) measure with these."""

from __future__ import annotations

import torch

from oneiter.format.schema import BACKWARD, FORWARD
from oneiter.record.local.montecarlo import spread
from oneiter.record.local.rerunning.rerun_metrics import rel_l2
from oneiter.record.local.rerunning.site import RunResult
from oneiter.record.local.rows import dtype_name
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.precision_modes import MANTISSA_BITS

__all__ = ["rel_all", "spread_all", "overflowed", "roundoff_of"]


def roundoff_of(dtype: str, amp, modes: dict[str, str]) -> float:
    """The unit roundoff a run computes in: its dtype's or autocast's, or its reduced float32 modes' (TF32: 2^-11)."""
    base = unit_roundoff(dtype_name(amp or dtype))
    if amp is None and dtype_name(dtype) == "float32" and modes:
        base = max(base, *(2.0 ** -(MANTISSA_BITS[m] + 1) for m in modes.values()))
    return base


def rel_all(run: RunResult, high: RunResult) -> dict[tuple[str, str], float]:
    """rel_l2 of every tensor of `run` against the same tensor of the high-precision run."""
    out = {}
    for phase, mine, theirs in ((FORWARD, run.forward, high.forward), (BACKWARD, run.backward, high.backward)):
        for name, value in mine.items():
            if name in theirs:
                out[(phase, name)] = rel_l2(theirs[name], value)
    return out


def spread_all(base: RunResult, samples: list[RunResult], scale: float | None = None) -> dict[tuple[str, str], float]:
    """The Monte Carlo noise of every tensor of `base`: `montecarlo.spread` of its perturbed samples (`scale`: its
    SCALE unless given)."""
    out = {}
    for phase, attr in ((FORWARD, "forward"), (BACKWARD, "backward")):
        for name, value in getattr(base, attr).items():
            values = [getattr(s, attr).get(name) for s in samples]
            if all(v is not None for v in values):
                out[(phase, name)] = spread(value, values) if scale is None else spread(value, values, scale)
    return out


def overflowed(base: RunResult, samples: list[RunResult]) -> list[tuple[str, str]]:
    """The tensors of `base` that are finite there and not in some sample (a run with rounding injected)."""
    found = []
    for phase, attr in ((FORWARD, "forward"), (BACKWARD, "backward")):
        for name, value in getattr(base, attr).items():
            if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                continue
            values = [getattr(s, attr).get(name) for s in samples]
            if any(v is not None and not bool(torch.isfinite(v).all()) for v in values):
                found.append((phase, name))
    return found
