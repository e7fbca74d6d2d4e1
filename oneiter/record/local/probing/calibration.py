"""The expected noise of a call's tensors: its rerun in the run's precision against a higher one, on the trusted
CPU or the device (`--calibrate`), with float32 or Monte Carlo where float64 cannot run (the module docstring of
`probe.py`, docs/blame.md).

Where this sits: the third floor of `LocalProbe` (`base.py`), over `NoiseBounds`: a probed call whose rows could be
flagged is calibrated here; what it reran goes into the sums for the parameter rows (`summed_rows.py`)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import REDUCED_CALLS, REDUCED_CALLS_REFERENCE, REDUCED_REFERENCE, REDUCED_TARGET, call_key
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.montecarlo import MONTE_CARLO, SAMPLES, SEED
from oneiter.record.local.probing.bounds import NoiseBounds
from oneiter.record.local.probing.noise import rel_all, spread_all
from oneiter.record.local.rerun import ProbeSkip, RunResult, Site
from oneiter.record.local.rows import JudgedRow, first_line
from oneiter.runtime.precision import unit_roundoff

__all__ = ["Calibration"]

_CPU = torch.device("cpu")


class Calibration(NoiseBounds):
    """Each calibrated call's noise, target's and reference's, by (phase, tensor), and how it was measured."""

    def _calibrate(self, rec: CallRecord, primary: RunResult, judged: list[JudgedRow]) -> None:
        """Measure the expected noise of every judged tensor of this call (and its parameter contributions)."""
        try:
            noise_t, noise_r, where = self._noise(rec, primary)
        except (ProbeSkip, OneIterError):
            raise
        except Exception as err:
            raise ProbeSkip(f"calibration failed: {type(err).__name__}: {first_line(err)}") from None
        bound = self._bounds.get(id(rec), {})
        for row in judged:
            key = (row.phase, row.tensor)
            if key in noise_t:
                row.noise_target = noise_t[key]
                row.noise_reference = noise_r.get(key, self._reference_default(noise_t[key]))
                row.calibration = where
                row.noise_bound = bound.get(key, math.nan)

    def _noise(self, rec: CallRecord, primary: RunResult | None):
        """(noise_target, noise_reference, how) by (phase, name); parameter contributions go into the sums.
        `primary` None: this call's primary rerun is not at hand (calibration after backward) and is redone if
        needed, with the run's autocast set explicitly. `how`: where, and `:float32`/`:monte_carlo` when the
        high-precision run failed (an op without a float64 kernel) and the noise was estimated without it."""
        high_site, low_site, where = self._calibration_sites()
        if primary is None and self._rerun_primary(low_site):
            primary = self._run(rec, self._primary_site(explicit=True))
        low = primary if low_site is None else self._run(rec, low_site)
        assert low is not None  # without a low site the primary rerun is it (`_rerun_primary` ran it again)
        self._note_reduced("low", low_site, rec)
        reference = self._reference_run(rec, primary)
        self._note_reduced("reference", self._reference_site_used, rec)
        high, how = self._high(rec, high_site, where)
        if high is None:
            noise_t, noise_r = self._monte_carlo(rec, low_site, low, reference)
        else:
            noise_t = rel_all(low, high)
            noise_r = rel_all(reference, high) if reference is not None else {}
            self._add(rec, {"high": high})
            if how == where and self._suspicious(noise_t, noise_r):
                try:
                    self._bounds[id(rec)] = self._bound(rec, high)
                except (ProbeSkip, OneIterError):
                    raise
                except Exception as err:  # noqa: BLE001 - the check could not be made: the noise stands unchecked,
                    self._not_bounded(call_key(rec.path, rec.call), err)  # and the report says so
        self._add(rec, {"low": low, **({"reference": reference} if reference is not None else {})})
        self._calibrated.setdefault(id(rec), how)
        return noise_t, noise_r, how

    def _high(self, rec: CallRecord, site: Site, where: str) -> tuple[RunResult | None, str]:
        """The high-precision run and how the noise is labelled; float32 when float64 fails in a coarser run
        (bf16, fp16); (None, where:monte_carlo) when no higher precision runs."""
        try:
            return self._run(rec, site), where
        except (ProbeSkip, OneIterError):
            raise
        except Exception:
            if site.cast != "float64" or self.run_roundoff <= unit_roundoff("float32"):
                return None, f"{where}:{MONTE_CARLO}"
        try:
            return self._run(rec, replace(site, cast="float32")), f"{where}:float32"
        except (ProbeSkip, OneIterError):
            raise
        except Exception:
            return None, f"{where}:{MONTE_CARLO}"

    def _monte_carlo(self, rec: CallRecord, low_site: Site | None, low: RunResult, reference: RunResult | None):
        """The noise without a higher precision: `SAMPLES` reruns in the run's own precision, inputs
        and weights perturbed at its unit roundoff (`rerun.Perturbation`), each against the unperturbed run; the
        RMS of their rel_l2, scaled (`montecarlo.py`, docs/blame.md). The same for the reference's precision
        when it is measured. The samples go into the sums (`mc<k>`, `mc_ref<k>`) for the parameter rows."""
        base_site = low_site or Site("low", self.device, live=False, cast="live", autocast=self.amp, params="live",
                                     trusted=False)
        base = low if low_site is not None else self._run(rec, base_site)
        runs = {"mc_base": base}
        samples = [self._run(rec, replace(base_site, name=f"mc{k}", perturb=(SEED + k, self.run_roundoff)))
                   for k in range(SAMPLES)]
        runs.update((f"mc{k}", run) for k, run in enumerate(samples))
        noise_t = spread_all(base, samples)
        noise_r: dict = {}
        sampling = self._reference_sampling() if reference is not None else None
        if sampling is not None and reference is not None:
            site, roundoff = sampling
            refs = [self._run(rec, replace(site, name=f"mc_ref{k}", perturb=(SEED + k, roundoff)))
                    for k in range(SAMPLES)]
            noise_r = spread_all(reference, refs)
            runs.update((f"mc_ref{k}", run) for k, run in enumerate(refs))
            runs["mc_ref_base"] = reference
        self._add(rec, runs)
        return noise_t, noise_r

    def _calibration_sites(self) -> tuple[Site, Site | None, str]:
        if self.where == "device":
            high = Site("high", self.device, live=False, cast=self._higher(), autocast=None, params=self.PARAMS,
                        trusted=False)
            return high, None, "device"
        high = Site("high", _CPU, live=False, cast="float64", autocast=None, params=self.PARAMS, trusted=True)
        low = Site("low", _CPU, live=False, cast="live", autocast=self.amp, params="live", trusted=True,
                   reduced=tuple(sorted(self.reduced.items())))
        return high, low, "cpu"

    def _note_reduced(self, side: str, site: Site | None, rec: CallRecord) -> None:
        """Count the call when the rerun standing for `side` rounded operands of a governed op."""
        if site is not None and site.reduced and self.rerunner.rounded:
            self._reduced_calls[side].add(id(rec))

    def _reduced_attrs(self) -> dict:
        """The /local attributes saying which reduced modes the calibration reproduced, and for how many calls."""
        low = self.reduced if self.where == "cpu" else {}  # device calibration: the device runs its own modes
        site = self._reference_site()
        ref = dict(site.reduced) if site is not None else {}
        return {REDUCED_TARGET: json.dumps(low, sort_keys=True), REDUCED_CALLS: len(self._reduced_calls["low"]),
                REDUCED_REFERENCE: json.dumps(ref, sort_keys=True),
                REDUCED_CALLS_REFERENCE: len(self._reduced_calls["reference"])}
