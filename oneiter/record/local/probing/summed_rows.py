"""Values summed over calls: a parameter's gradient (every call's own contribution) and a buffer's update, judged
with a noise from the sums of the contributing calls' calibration runs.

Where this sits: the fourth floor of `LocalProbe` (`base.py`), over `Calibration`: once backward is over, the probe
writes one `param_grad` row per parameter here (and the teacher-forced probe its buffer rows, `probe.py`)."""

from __future__ import annotations

import math

from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.montecarlo import MONTE_CARLO, SAMPLES, spread
from oneiter.record.local.probing.calibration import Calibration
from oneiter.record.local.rerun import rel_l2
from oneiter.record.local.rows import JudgedRow, first_line, leaf, owner
from oneiter.runtime.names import parameters

__all__ = ["SummedValues"]


class SummedValues(Calibration):
    """The parameter-gradient rows, and the noise of any value summed over calls."""

    def _param_rows(self) -> None:
        """One row per parameter gradient: the sum of every call's own contribution, judged like any tensor."""
        for index, (name, param) in enumerate(parameters(self.model)):
            records = self._contributors.get(name)
            judged = self._sums.get("primary", name)
            if not records or judged is None or name in self._not_summed:
                continue
            stored = self._stored_grad(name, param)
            if stored is None or tuple(stored.shape) != tuple(judged.shape):
                continue
            judged = judged.to(self._summed_grad_dtype(stored, param))
            row = self._row(owner(name), 0, "param_grad", leaf(name), stored, judged, index)
            if self.recipes.owns(name):
                self.recipes.param_row(name, row, judged, stored, self._sides)
            elif row.needs_noise(self.run_roundoff):
                self._calibrated_value(name, records, row)
            self.rows.append(row)

    def _calibrated_value(self, name: str, records: list[CallRecord], row: JudgedRow) -> None:
        """Noise of a parameter gradient (summed over calls) or of a buffer's update, calibrating calls as needed.
        When any contributing call had no high-precision run, every one is sampled and the sums' spread is used."""
        try:
            for rec in records:
                if id(rec) not in self._calibrated:
                    self._noise(rec, None)
                    self.source.clear()
            sampled = any(self._calibrated[id(rec)].endswith(MONTE_CARLO) for rec in records)
            for rec in records if sampled else ():
                if (id(rec), "mc0") not in self._added:
                    self._monte_carlo_again(rec)
        except Exception as err:
            row.calibration = f"failed: {type(err).__name__}: {first_line(err)}"[:200]
            return
        if sampled:
            self._sampled_value(name, row)
            return
        high, low = self._sums.get("high", name), self._sums.get("low" if self.where == "cpu" else "primary", name)
        if high is None or low is None:
            return
        row.noise_target = rel_l2(high, low)
        ref = self._sums.get("reference", name)
        row.noise_reference = rel_l2(high, ref) if ref is not None else self._reference_default(row.noise_target)
        row.calibration = self._calibrated[id(records[0])].partition(":")[0] + (
            ":float32" if any(self._calibrated[id(r)].endswith("float32") for r in records) else "")
        if row.noise_target + row.noise_reference > self._gate() and not row.calibration.endswith("float32"):
            self._check_summed(name, records, row)

    def _check_summed(self, name: str, records: list[CallRecord], row: JudgedRow) -> None:
        """The bound of a summed value (`_summed_bound`), measuring each contributing call's bound runs first."""
        try:
            for rec in records:
                if (id(rec), "inj0") not in self._added:
                    self._bound(rec, None)
                    self.source.clear()
        except Exception as err:  # noqa: BLE001 - the check could not be made: the noise stands unchecked (NaN
            self._not_bounded(name, err)  # bound), and the report says so
            return
        bound = self._summed_bound(name)
        if bound is None:
            self._not_bounded(name, "a contributing call's bound runs are missing")
        row.noise_bound = math.nan if bound is None else bound

    def _monte_carlo_again(self, rec: CallRecord) -> None:
        """Monte Carlo samples of a call that was calibrated in a higher precision: a parameter it contributes to
        shares a call that could not be."""
        _, low_site, _ = self._calibration_sites()
        primary = self._run(rec, self._primary_site(explicit=True)) if self._rerun_primary(low_site) else None
        low = primary if low_site is None else self._run(rec, low_site)
        assert low is not None  # without a low site the primary rerun is it (`_rerun_primary` ran it again)
        self._monte_carlo(rec, low_site, low, self._reference_run(rec, primary))
        self.source.clear()

    def _sampled_value(self, name: str, row: JudgedRow) -> None:
        """A summed value's Monte Carlo noise: the spread of the summed samples around the summed base runs."""
        base = self._sums.get("mc_base", name)
        samples = [self._sums.get(f"mc{k}", name) for k in range(SAMPLES)]
        if base is None or any(s is None for s in samples):
            return
        row.noise_target = spread(base, samples)
        ref_base = self._sums.get("mc_ref_base", name)
        refs = [self._sums.get(f"mc_ref{k}", name) for k in range(SAMPLES)]
        if ref_base is not None and all(r is not None for r in refs):
            row.noise_reference = spread(ref_base, refs)
        else:
            row.noise_reference = self._reference_default(row.noise_target)
        row.calibration = f"{self.where}:{MONTE_CARLO}"
