"""The check of a noise estimate: a calibrated noise above the gate is held to what the precision can produce for
the call on the trusted path (`_bound`, the rows' `noise_bound`; docs/blame.md "A noise estimate is itself checked").

Where this sits: the second floor of `LocalProbe` (`base.py`), over `ProbeState`; the calibration (`calibration.py`)
asks it after a call's high-precision run, the summed values (`summed_rows.py`) for a parameter's gradient."""

from __future__ import annotations

from dataclasses import replace

import torch

from oneiter.format.schema import call_key
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.montecarlo import BOUND_SAMPLES, SEED, spread
from oneiter.record.local.probing.noise import overflowed, rel_all, roundoff_of, spread_all
from oneiter.record.local.probing.state import ProbeState
from oneiter.record.local.rerun import RunResult, Site, rel_l2
from oneiter.record.local.rows import dtype_name, first_line
from oneiter.runtime.precision import NOISE_BOUND_FACTOR, unit_roundoff

__all__ = ["NoiseBounds"]

_CPU = torch.device("cpu")


class NoiseBounds(ProbeState):
    """The bound a calibrated noise is checked against, and the bounds that could not be measured (`UNBOUNDED`)."""

    def _gate(self) -> float:
        """A calibrated noise (target's plus reference's) above this is checked against what the precision can
        produce (`_bound`): NOISE_BOUND_FACTOR unit roundoffs of the coarser side's precision, reduced modes
        (TF32) included. Below it no check could fail."""
        mine = roundoff_of(dtype_name(self.dtype), self.amp, self.reduced)
        if self._reference_site() is not None:
            ref_dtype, ref_amp = self.ref_precision or (dtype_name(self.dtype), self.amp)
            mine = max(mine, roundoff_of(ref_dtype, ref_amp, self.ref_reduced))
        return NOISE_BOUND_FACTOR * mine

    def _suspicious(self, noise_t: dict, noise_r: dict) -> bool:
        gate = self._gate()
        return any(v + noise_r.get(k, self._reference_default(v)) > gate for k, v in noise_t.items())

    def _bound(self, rec: CallRecord, high: RunResult | None) -> dict[tuple[str, str], float]:
        """What the precision can produce for each tensor of this call, measured on the trusted path (the CPU,
        torch's kernels): the spread of `BOUND_SAMPLES` float64 runs with the run's rounding injected into every
        op (`roundoff_mode.py`) around the plain float64 run; with `--calibrate device`, at least the trusted CPU's
        own noise (the run's precision, its reduced modes rounded as it ran them, against float64). Both sides:
        the reference's part scaled by its roundoff (none when finer). The runs go into the sums (`bound_*`,
        `inj<k>`) for the parameter rows."""
        base_site = Site("high", _CPU, live=False, cast="float64", autocast=None, params=self.PARAMS, trusted=True)
        label = "high" if self.where == "cpu" else "bound_high"
        base = high if self.where == "cpu" and high is not None else self._run(rec, base_site)
        runs = {label: base}
        if self.where == "device":
            runs["bound_low"] = self._run(rec, Site("bound_low", _CPU, live=False, cast="live", autocast=self.amp,
                                                    params="live", trusted=True,
                                                    reduced=tuple(sorted(self.reduced.items()))))
        roundoff = unit_roundoff(dtype_name(self.amp or self.dtype))
        families = tuple(sorted(self.reduced.items())) if self.amp is None and self.dtype == torch.float32 else ()
        for k in range(BOUND_SAMPLES):
            runs[f"inj{k}"] = self._run(rec, replace(base_site, name=f"inj{k}", inject=(
                SEED + k, roundoff, min(roundoff, unit_roundoff("float32")), families)))
        self._add(rec, runs)
        samples = [runs[f"inj{k}"] for k in range(BOUND_SAMPLES)]
        spread_t = spread_all(base, samples, 1.0)
        for key in overflowed(base, samples):  # the code's own cast to a narrow format overflowed: nothing measured
            del spread_t[key]
            self._not_bounded(f"{call_key(rec.path, rec.call)} {key[0]} {key[1]}", "its values turned NaN or Inf "
                              "with the precision's rounding injected (a cast in the model's code to a narrow format "
                              "overflows): its calibrated noise stands unchecked")
        cpu = rel_all(runs["bound_low"], base) if "bound_low" in runs else {}
        both = 1.0 + self._reference_bound_scale()
        return {key: max(value, cpu.get(key, 0.0)) * both for key, value in spread_t.items()}

    def _summed_bound(self, name: str) -> float | None:
        """`_bound` of a value summed over calls (a parameter's gradient, a buffer's update), from the sums."""
        base = self._sums.get("high" if self.where == "cpu" else "bound_high", name)
        samples = [self._sums.get(f"inj{k}", name) for k in range(BOUND_SAMPLES)]
        if base is None or any(s is None for s in samples):
            return None
        low = self._sums.get("bound_low", name)
        value = max(spread(base, samples, 1.0), rel_l2(base, low) if low is not None else 0.0)
        return value * (1.0 + self._reference_bound_scale())

    def _reference_bound_scale(self) -> float:
        """The reference's share of a bound, relative to the target's: 1 in the same precision, the ratio of their
        roundoffs where the reference's run is measured, 0 where it is finer (not measured)."""
        if self._same_as_reference():
            return 1.0
        site = self._reference_site()
        if site is None:
            return 0.0
        ref_dtype, ref_amp = self.ref_precision or (dtype_name(self.dtype), self.amp)
        return (roundoff_of(ref_dtype, ref_amp, self.ref_reduced)
                / roundoff_of(dtype_name(self.dtype), self.amp, self.reduced))

    def _not_bounded(self, what: str, why) -> None:
        """A noise bound that was needed (the calibrated noise is above the gate) and could not be measured: kept
        for `/local`'s UNBOUNDED attribute, which every report states."""
        reason = why if isinstance(why, str) else f"{type(why).__name__}: {first_line(why)}"
        self._unbounded.append({"what": what, "reason": reason[:200]})
