"""Each step of two multi-step recordings measured: its error, and the band of what the precision explains.

Both files hold one signature row per step (`format/signature.py`: the loss, each parameter's gradient and update
norm) and, per step, the statistics and checksum of every tensor. Per step:

- **error** = `distance(target, reference)`, per group of the signature's columns (`GROUPS`: `gradients`, the
  loss and each parameter's gradient norm; `updates`, each parameter's update norm): the root mean square, over the
  group's columns, of the symmetric relative difference |a - b| / max(|a|, |b|) (columns that are 0 on both sides
  left out): how far the target's step is from the reference's, inherited from earlier steps or made by this one;
- **band** = `BAND_FACTOR` x the largest `distance(twin, target)` of the group so far: the twin
  (`record/steps/twin.py`) is the target's own run with one rounding of the lower precision injected into every
  step, so its drift from the target is the drift a precision change makes on this model, learning rate and
  optimizer, inherited error included; never less than `BAND_FACTOR` x the lower precision's unit roundoff (as a
  call's expected noise never is). For the `updates` group of a target whose weights are *stored* in a lower
  precision than the reference's (`--dtype bfloat16`), also never less than what that storage does to an update by
  itself (`storage_floor`: rounding w + d to the weight's dtype moves each element by at most u |w + d|, so the
  update's norm by at most u (||w|| + ||d||), with ||w|| the target's recorded weight norm at the step's start): a
  bound computed from the storage format and the recorded weights, never from the target's own step, which is what
  is judged. How `BAND_FACTOR` was measured: docs/steps.md (`bench/bench_steps.py`);
- a step is **outside the band** when a group's error exceeds its band, or when NaN/Inf appear in its signature on
  one side only. A target recorded without a twin has no band: each step is held to the tolerance of the lower
  precision (`tolerance_band`).

Sits under the verdict (`step_verdict.py`), which names the first step outside; `step_compare.py` drives both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.signature import GROUPS, UPDATE, Signature
from oneiter.formatting import rel_diff
from oneiter.judge.iteration.pairing import causal_pairs, positions
from oneiter.judge.measure.tolerance import default_tolerance
from oneiter.runtime.precision import amp_dtype_name, unit_roundoff

__all__ = ["BAND_FACTOR", "DECORRELATED", "StepRow", "distance", "step_rows", "storage_floor", "tolerance_band",
           "first_entry"]

BAND_FACTOR = 4.0
"""The band is this many times the twin's drift (its running maximum). Measured, not chosen: docs/steps.md gives
the clean runs' largest error/drift ratios and the faults' smallest, from `bench/bench_steps.py`."""

DECORRELATED = 0.1
"""A group whose band exceeds this is not judged at that step: two runs one rounding apart already differ by more
than `DECORRELATED / BAND_FACTOR` (2.5 %) in their norms (or the weights' storage rounds the updates away), so a
step's own error can no longer be told from what it inherited. A limit of usefulness, not of the band: clean
Hugging Face runs stay under 0.03 in bf16; resnet18 at 32x32 and batch 8 passes it by step 4 in float32, two
valid runs' losses 3.92 and 2.89 by step 9 (docs/steps.md). Steps judged on no group make the verdict inconclusive
(never a match) from the first of them."""


def distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: the RMS over columns of |a - b| / max(|a|, |b|), columns 0 on both sides left out (module
    docstring); NaN where a row has no column to compare."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    scale = np.maximum(np.abs(a), np.abs(b))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(a - b) / scale
    used = (scale > 0) & np.isfinite(rel)
    count = used.sum(axis=1)
    total = np.where(used, rel, 0.0).__pow__(2).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.sqrt(total / np.maximum(count, 1)), math.nan)


def _nonfinite_differs(a: np.ndarray, b: np.ndarray) -> bool:
    return bool((np.isfinite(a) != np.isfinite(b)).any() or (np.isnan(a) != np.isnan(b)).any())


@dataclass
class StepRow:
    """One step of the comparison: the table's numbers, and per group of the signature's columns (`GROUPS`) its
    error and band; the step's `error`, `band` and `ratio` are those of the group nearest its band (`by`)."""

    step: int
    loss: tuple[float, float]
    grad_norm: tuple[float, float]
    update_norm: tuple[float, float]
    errors: dict[str, float]
    bands: dict[str, Optional[float]]
    bitwise: bool
    nonfinite: bool = False
    twin: Optional[tuple[float, float, float]] = None  # the twin's loss, gradient norm and update norm
    status: str = ""

    def judges(self, group: str) -> bool:
        """Whether `group` is judged at this step: a band, and one that does not exceed `DECORRELATED`."""
        band = self.bands.get(group)
        return band is not None and band <= DECORRELATED

    @property
    def judged(self) -> bool:
        """Bitwise, NaN/Inf on one side only, or at least one group judged: the step has a verdict of its own."""
        return self.bitwise or self.nonfinite or any(self.judges(g) for g in self.errors)

    def _ratio(self, group: str) -> float:
        error, band = self.errors.get(group, math.nan), self.bands.get(group)
        if not math.isfinite(error) or not self.judges(group):
            return -math.inf
        return error / band if band else (math.inf if error > 0 else 0.0)

    @property
    def by(self) -> str:
        """The group whose error is nearest (or furthest beyond) its band."""
        return max(self.errors, key=self._ratio) if self.errors else next(iter(GROUPS))

    @property
    def error(self) -> float:
        return self.errors.get(self.by, math.nan)

    @property
    def band(self) -> Optional[float]:
        return self.bands.get(self.by)

    @property
    def outside(self) -> bool:
        return self.nonfinite or any(self._ratio(g) > 1 for g in self.errors)

    @property
    def ratio(self) -> Optional[float]:
        value = self._ratio(self.by)
        return None if value == -math.inf or math.isinf(value) and self.band is None else value

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "status": self.status, "bitwise": self.bitwise}
        for name in ("loss", "grad_norm", "update_norm"):
            ref, tgt = getattr(self, name)
            out[name] = {"reference": ref, "target": tgt, "difference": rel_diff(tgt, ref)}
        out.update({"error": self.error, "band": self.band, "ratio": self.ratio, "by": self.by,
                    "nonfinite": self.nonfinite,
                    "groups": {g: {"error": self.errors[g], "band": self.bands.get(g), "judged": self.judges(g)}
                               for g in self.errors}})
        if self.twin is not None:
            out["twin"] = dict(zip(("loss", "grad_norm", "update_norm"), self.twin, strict=True))
        return out


def step_rows(ref: IterationFile, tgt: IterationFile, steps: list[int], mine: Signature, theirs: Signature,
              twin: Optional[Signature]) -> list[StepRow]:
    """One row per step: the three numbers of both runs (and the twin's), each group's error and band, whether the
    step is bitwise the reference's and whether NaN/Inf differ (its status is the verdict's to set)."""
    index_ref = [mine.steps.index(s) for s in steps]
    index_tgt = [theirs.steps.index(s) for s in steps]
    errors, bands, nonfinite = {}, {}, np.zeros(len(steps), dtype=bool)
    check, fixed = _check_floor(tgt), tolerance_band(ref, tgt)
    for group in GROUPS:
        a, b = theirs.aligned(mine, group)  # target's and reference's values on the same columns
        a, b = a[index_tgt], b[index_ref]
        errors[group] = distance(a, b)
        nonfinite |= np.array([_nonfinite_differs(x, y) for x, y in zip(a, b, strict=True)], dtype=bool)
        if twin is None:
            bands[group] = [fixed] * len(steps)
            continue
        t, own = twin.aligned(theirs, group)
        drift = distance(t[index_tgt], own[index_tgt])
        floor = storage_floor(ref, tgt, steps, theirs, a, b) if group == "updates" else np.zeros(len(steps))
        envelope, bands[group] = max(check, _roundoff(tgt)), []
        for value, own_floor in zip(drift, floor, strict=True):  # the largest drift so far: what earlier steps left
            envelope = max(envelope, float(value) if math.isfinite(value) else 0.0)
            bands[group].append(BAND_FACTOR * max(envelope, float(own_floor)))
    rows = []
    for i, step in enumerate(steps):
        k, j = index_ref[i], index_tgt[i]
        rows.append(StepRow(
            step=step, loss=(float(mine.loss[k]), float(theirs.loss[j])),
            grad_norm=(float(mine.grad_norm[k]), float(theirs.grad_norm[j])),
            update_norm=(float(mine.update_norm[k]), float(theirs.update_norm[j])),
            errors={g: float(errors[g][i]) for g in GROUPS}, bands={g: bands[g][i] for g in GROUPS},
            bitwise=_bitwise(ref.step(step), tgt.step(step)), nonfinite=bool(nonfinite[i]),
            twin=None if twin is None else (float(twin.loss[j]), float(twin.grad_norm[j]),
                                            float(twin.update_norm[j]))))
    return rows


def storage_floor(ref: IterationFile, tgt: IterationFile, steps: list[int], theirs: Signature, a: np.ndarray,
                  b: np.ndarray) -> np.ndarray:
    """Per step, what storing the target's weights in a lower precision than the reference's does to its update
    norms by itself, in `distance`'s units (module docstring): per parameter column u (||w|| + ||d||) / max(|a|,
    |b|), capped at 1, u the unit roundoff of the target's weight dtype (0 where it is not lower than the
    reference's), ||w|| the target's recorded weight norm at the step's start, ||d|| its update norm; the root
    mean square over the columns `distance` uses. `a`, `b`: the target's and reference's update norms (steps x
    columns, `theirs`' update columns in order). Zero where no weight is stored lower."""
    names = [c[len(UPDATE):] for c in theirs.columns if c.startswith(UPDATE)]
    first_ref, first_tgt = ref.step(steps[0]).state(), tgt.step(steps[0]).state()
    rounding = np.array([_lower_roundoff(ref.step(steps[0]), tgt.step(steps[0]), first_ref.get(n), first_tgt.get(n))
                         for n in names])
    if not rounding.any():
        return np.zeros(len(steps))
    weights = np.array([_weight_norms(tgt.step(s), names, rounding) for s in steps])
    scale = np.maximum(np.abs(a), np.abs(b))
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = np.minimum(rounding * (weights + np.abs(a)) / scale, 1.0)
    used = (scale > 0) & np.isfinite(np.abs(a - b) / np.where(scale > 0, scale, 1.0)) & np.isfinite(bound)
    count = used.sum(axis=1)
    total = np.where(used, bound, 0.0).__pow__(2).sum(axis=1)
    return np.where(count > 0, np.sqrt(total / np.maximum(count, 1)), 0.0)


def _lower_roundoff(ref_view: IterationFile, tgt_view: IterationFile, ref_path, tgt_path) -> float:
    """u of the target's weight dtype where it is lower than the reference's, else 0."""
    if ref_path is None or tgt_path is None:
        return 0.0
    try:
        mine, theirs = unit_roundoff(tgt_view.dtype_of(tgt_path)), unit_roundoff(ref_view.dtype_of(ref_path))
    except (KeyError, ValueError, OneIterError):
        return 0.0
    return mine if mine > theirs else 0.0


def _weight_norms(view: IterationFile, names: list[str], rounding: np.ndarray) -> list[float]:
    """The step's recorded weight norm of each parameter stored lower (`rounding` > 0), 0.0 for the others."""
    state = view.state()
    return [_norm(view, state.get(n)) if u else 0.0 for n, u in zip(names, rounding, strict=True)]


def _norm(view: IterationFile, path) -> float:
    """The L2 norm of a recorded weight: its statistics, or its data (a first step's weights are in full)."""
    if path is None:
        return 0.0
    if view.is_stats(path):
        return view.stats_of(path)["l2"]
    return float(np.linalg.norm(view.read(path).astype(np.float64).reshape(-1)))


def _roundoff(tgt: IterationFile) -> float:
    """The unit roundoff of the lower of the two precisions (the twin's perturbation): no band is below it, as no
    expected noise of a call is (docs/blame.md)."""
    value = tgt.meta.get("twin_roundoff")
    return float(value) if isinstance(value, float) and math.isfinite(value) and value >= 0 else 0.0


def _check_floor(tgt: IterationFile) -> float:
    """The twin's check on the first step (its distance unperturbed from the run; 0 on the CPU, where it must be
    bitwise): a floor of the band off the CPU."""
    value = tgt.meta.get("twin_check")
    return float(value) if isinstance(value, float) and math.isfinite(value) else 0.0


def tolerance_band(ref: IterationFile, tgt: IterationFile) -> float:
    """Without a twin: the rtol of the lower of the two runs' precisions (`torch.testing.assert_close`'s)."""
    names = [amp_dtype_name(f.meta.get("amp")) or str(f.meta.get("dtype") or "float32") for f in (ref, tgt)]
    lower = max(names, key=unit_roundoff)
    return default_tolerance(lower).rtol


def _bitwise(a: IterationFile, b: IterationFile) -> bool:
    """Whether every statistic the target recorded of the step is the reference's bit for bit (same entries, same
    checksums; the reference's full tensors, its first step's weights and batch, by the checksum of their data)."""
    theirs = b.stats_index
    if not theirs or not set(a.stats_index) <= set(theirs):
        return False
    for path, (stats, dtype, shape) in theirs.items():
        if not a.has(path) or a.dtype_of(path) != dtype or a.shape_of(path) != shape:
            return False
        if a.stats_of(path).checksum != stats.checksum:
            return False
    return True


def first_entry(a: IterationFile, b: IterationFile) -> Optional[str]:
    """The first entry of the step, in causal order, whose statistics are not the reference's bit for bit."""
    for re_, te in causal_pairs(list(a.entries()), list(b.entries()), positions(a), positions(b)):
        if re_ is None or te is None:
            entry = re_ or te
            assert entry is not None  # a pair holds at least one side
            return f"{entry.module}@{entry.call} {entry.phase} {entry.tensor}"
        if not a.is_stats(re_.path) or not b.is_stats(te.path):
            continue
        sa, sb = a.stats_of(re_.path), b.stats_of(te.path)
        if sa.checksum != sb.checksum or a.shape_of(re_.path) != b.shape_of(te.path):
            return f"{re_.module}@{re_.call} {re_.phase} {re_.tensor}"
    return None
