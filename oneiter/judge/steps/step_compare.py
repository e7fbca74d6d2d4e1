"""`oneiter compare` of two multi-step recordings: which iteration first goes wrong, and how to record it in full.

Sits beside the one-iteration engine (`engine.py`): both files hold one signature row per step (`format/signature.py`:
the loss, each parameter's gradient and update norm) and, per step, the statistics and checksum of every tensor.
Per step:

- **error** = `distance(target, reference)`, per group of the signature's columns (`GROUPS`: `gradients`, the
  loss and each parameter's gradient norm; `updates`, each parameter's update norm): the root mean square, over the
  group's columns, of the symmetric relative difference |a - b| / max(|a|, |b|) (columns that are 0 on both sides
  left out): how far the target's step is from the reference's, inherited from earlier steps or made by this one;
- **band** = `BAND_FACTOR` x the largest `distance(twin, target)` of the group so far: the twin
  (`record/steps/twin.py`) is the target's own run with one rounding of the lower precision injected into every step,
  so its drift from the target is the drift a precision change makes on this model, learning rate and optimizer,
  inherited error included; never less than `BAND_FACTOR` x the lower precision's unit roundoff (as a call's
  expected noise never is). For the `updates` group of a target whose weights are *stored* in a lower precision
  than the reference's (`--dtype bfloat16`), also never less than what that storage does to an update by itself
  (`storage_floor`: rounding w + d to the weight's dtype moves each element by at most u |w + d|, so the update's
  norm by at most u (||w|| + ||d||), with ||w|| the target's recorded weight norm at the step's start): a bound
  computed from the storage format and the recorded weights, never from the target's own step, which is what is
  judged. How `BAND_FACTOR` was measured: docs/steps.md (`bench/bench_steps.py`);
- a step is **outside the band** when a group's error exceeds its band, or when NaN/Inf appear in its signature on
  one side only. Its own computation put it there: every earlier step was within what the precision explains, and the
  band grows as an error inherited from them grows. The verdict names the **first** such step (`verdict.step`,
  exit 1), with the two commands that record that step in full on both sides (`record --step S`, then
  `record --replay`), where the one-iteration blame names the layer.

A target recorded without a twin (the Hugging Face callback, the mmengine hook, `twin=False`) has no band: each
step is then held to the tolerance of the lower precision (`torch.testing.assert_close`'s rtol), and the verdict
says so (basis `tolerance`). Steps whose every statistic is bitwise the reference's (checksums) are `bitwise`; at
the first step that is not, after bitwise steps, the first entry in causal order that differs is named too.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from oneiter.errors import FormatError, OneIterError
from oneiter.format.layout import IterationFile, reading
from oneiter.format.signature import GROUPS, UPDATE, Signature
from oneiter.judge.iteration.pairing import causal_pairs, check_compatible, check_replay, positions, same_start
from oneiter.judge.iteration.verdict import EXIT_CODES, json_ready
from oneiter.judge.measure.tolerance import default_tolerance
from oneiter.runtime.modelspec import is_file_spec
from oneiter.runtime.precision import amp_dtype_name, unit_roundoff

__all__ = ["BAND_FACTOR", "StepRow", "StepVerdict", "StepsResult", "compare_steps", "distance", "is_steps"]

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

META_KEYS = ("model", "device", "dtype", "amp", "optimizer", "num_threads", "batch_size", "seed", "steps",
             "twin_roundoff", "twin_check")


def is_steps(path) -> bool:
    """Whether the file at `path` is a multi-step recording (its root attribute `steps`; read without validating:
    `compare_steps` opens it properly)."""
    import h5py

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # a FIFO would block h5py's open: the one-iteration path refuses it, in its words
        with h5py.File(path, "r") as f:
            return "steps" in f.attrs
    except Exception:  # noqa: BLE001 - h5py raises OSError, KeyError, ValueError... on a damaged header
        return False  # not readable as HDF5: the one-iteration path says why, in its words


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
            out[name] = {"reference": ref, "target": tgt, "difference": _rel(tgt, ref)}
        out.update({"error": self.error, "band": self.band, "ratio": self.ratio, "by": self.by,
                    "nonfinite": self.nonfinite,
                    "groups": {g: {"error": self.errors[g], "band": self.bands.get(g), "judged": self.judges(g)}
                               for g in self.errors}})
        if self.twin is not None:
            out["twin"] = dict(zip(("loss", "grad_norm", "update_norm"), self.twin, strict=True))
        return out


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale and math.isfinite(scale) else math.nan


@dataclass
class StepVerdict:
    """What a comparison of two multi-step recordings says: the first step outside the band, and how to record it."""

    status: str  # match or diverged
    basis: str  # band (the twin's) or tolerance (no twin: the lower precision's rtol)
    step: Optional[int]
    headline: str
    details: list[str]
    warnings: list[str] = field(default_factory=list)
    commands: Optional[list[str]] = None
    first_difference: Optional[int] = None  # the first step not bitwise the reference's
    entry: Optional[str] = None  # the first entry of that step that differs, when the steps before were bitwise
    factor: float = BAND_FACTOR
    num_steps: int = 0

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def lines(self) -> list[str]:
        return [self.headline, *self.details]

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "basis": self.basis, "step": self.step, "headline": self.headline,
                "details": list(self.details), "warnings": list(self.warnings), "commands": self.commands,
                "first_difference_step": self.first_difference, "entry": self.entry, "band_factor": self.factor,
                "num_steps": self.num_steps}


@dataclass
class StepsResult:
    """Two multi-step recordings compared step by step (`compare_steps`)."""

    reference: str
    target: str
    meta_reference: dict[str, Any]
    meta_target: dict[str, Any]
    rows: list[StepRow]
    verdict_obj: StepVerdict
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.verdict_obj.status

    @property
    def exit_code(self) -> int:
        return self.verdict_obj.exit_code

    @property
    def step(self) -> Optional[int]:
        return self.verdict_obj.step

    def verdict(self) -> dict[str, Any]:
        return self.verdict_obj.as_dict()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "steps", "verdict": self.verdict(), "reference": self.reference, "target": self.target,
                "meta": {"reference": self.meta_reference, "target": self.meta_target},
                "steps": [row.as_dict() for row in self.rows]}

    def to_json(self) -> dict[str, Any]:
        return json_ready(self.as_dict())


def compare_steps(reference, target) -> StepsResult:
    """Compare two multi-step recordings (the target a replay of the reference, ideally: `record --replay`)."""
    with IterationFile(reference) as ref, IterationFile(target) as tgt, reading(reference, target):
        return _compare_open(ref, tgt)


def _compare_open(ref: IterationFile, tgt: IterationFile) -> StepsResult:
    if not (ref.steps() and tgt.steps()):
        one, many = (ref, tgt) if not ref.steps() else (tgt, ref)
        raise FormatError(f"'{many.path}' records {len(many.steps())} steps and '{one.path}' one iteration: compare "
                          f"two multi-step recordings (record --steps), or two of one iteration")
    steps = [s for s in tgt.steps() if s in set(ref.steps())]
    if not steps or steps != ref.steps()[:len(steps)]:
        raise FormatError(f"'{tgt.path}' holds steps {tgt.steps()[:3]}..., not the first steps of '{ref.path}': "
                          f"record the target with --replay {ref.path}")
    first = steps[0]
    check_compatible(ref.step(first), tgt.step(first))
    notes = []
    note = check_replay(ref.step(first), tgt.step(first))
    if note:
        notes.append(note)
    else:
        _check_batches(ref, tgt, steps[1:])
    mine, theirs = ref.signature(), tgt.signature()
    if mine is None or theirs is None:
        raise FormatError(f"'{ref.path if mine is None else tgt.path}' holds no /signature table")
    rows = _rows(ref, tgt, steps, mine, theirs, tgt.signature(twin=True))
    verdict = _decide(ref, tgt, rows, notes)
    return StepsResult(str(ref.path), str(tgt.path), _meta(ref), _meta(tgt), rows, verdict, notes)


def _check_batches(ref: IterationFile, tgt: IterationFile, steps: list[int]) -> None:
    """Every later step ran on the reference's batch (checksums): else the two runs saw other data."""
    for step in steps:
        a, b = ref.step(step), tgt.step(step)
        pairs = list(zip(a.batch_paths(), b.batch_paths(), strict=False))
        if len(a.batch_paths()) != len(b.batch_paths()) or not all(same_start(a, b, p, q) for p, q in pairs):
            raise FormatError(f"bad replay: the target's batch of step {step} is not the reference's; record the "
                              f"target again with --replay {ref.path}")


def _finite(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values), values, 0.0)


def _rows(ref, tgt, steps: list[int], mine: Signature, theirs: Signature, twin: Optional[Signature]) -> list[StepRow]:
    index_ref = [mine.steps.index(s) for s in steps]
    index_tgt = [theirs.steps.index(s) for s in steps]
    errors, bands, nonfinite = {}, {}, np.zeros(len(steps), dtype=bool)
    check, fixed = _check_floor(tgt), _band(ref, tgt)
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
            step, (float(mine.loss[k]), float(theirs.loss[j])), (float(mine.grad_norm[k]), float(theirs.grad_norm[j])),
            (float(mine.update_norm[k]), float(theirs.update_norm[j])),
            {g: float(errors[g][i]) for g in GROUPS}, {g: bands[g][i] for g in GROUPS},
            _bitwise(ref.step(step), tgt.step(step)), bool(nonfinite[i]),
            None if twin is None else (float(twin.loss[j]), float(twin.grad_norm[j]), float(twin.update_norm[j]))))
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


def _band(ref: IterationFile, tgt: IterationFile) -> float:
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


def _first_entry(a: IterationFile, b: IterationFile) -> Optional[str]:
    """The first entry of the step, in causal order, whose statistics are not the reference's bit for bit."""
    for re_, te in causal_pairs(list(a.entries()), list(b.entries()), positions(a), positions(b)):
        if re_ is None or te is None:
            entry = re_ or te
            return f"{entry.module}@{entry.call} {entry.phase} {entry.tensor}"
        if not a.is_stats(re_.path) or not b.is_stats(te.path):
            continue
        sa, sb = a.stats_of(re_.path), b.stats_of(te.path)
        if sa.checksum != sb.checksum or a.shape_of(re_.path) != b.shape_of(te.path):
            return f"{re_.module}@{re_.call} {re_.phase} {re_.tensor}"
    return None


def _basis(ref: IterationFile, tgt: IterationFile, rows: list[StepRow], warnings: list[str]) -> str:
    """`band` (the twin's), or `tolerance` where there is no twin or the twin failed its check (the rows' bands
    replaced by the tolerance then); the reasons appended to `warnings`."""
    if tgt.signature(twin=True) is None:
        warnings.append(f"'{tgt.path}' has no twin (recorded without one: a framework callback, or twin=False): "
                        f"each step is held to the tolerance of the lower precision (rtol {rows[0].band:.1e}), not "
                        f"to a measured band; replay with `oneiter record --replay {ref.path} --steps N` for one")
        return "tolerance"
    check = tgt.meta.get("twin_check")
    if str(tgt.meta.get("device", "cpu")).startswith("cpu") and isinstance(check, float) and check > 0:
        warnings.append(f"the twin did not reproduce the target's first step unperturbed (distance {check:.2e}, "
                        f"where the CPU must give 0): its band is not evidence; steps judged by tolerance instead")
        band = _band(ref, tgt)
        for row in rows:
            row.bands = dict.fromkeys(row.bands, band)
        return "tolerance"
    return "band"


def _decide(ref: IterationFile, tgt: IterationFile, rows: list[StepRow], notes: list[str]) -> StepVerdict:
    warnings = list(notes)
    basis = _basis(ref, tgt, rows, warnings)
    first_diff = next((r.step for r in rows if not r.bitwise), None)
    flagged = next((r for r in rows if r.outside), None)
    for row in rows:  # bitwise statistics and a signature the band does not hold: the file contradicts itself
        row.status = "outside band" if row.outside else ("bitwise" if row.bitwise else
                                                         "within band" if row.judged else "not judged")
    unjudged = [r for r in rows if not r.judged]
    entry = None
    if first_diff is not None and (first_diff == rows[0].step or rows[[r.step for r in rows].index(first_diff) - 1]
                                   .bitwise):
        entry = _first_entry(ref.step(first_diff), tgt.step(first_diff))
    what = "the band (what the precision explains, measured by the twin)" if basis == "band" else \
        "the tolerance of the lower precision"
    details = [f"basis: per step, the signature's error (loss, each parameter's gradient and update norm) against "
               f"{what}; {len(rows)} steps, {sum(r.bitwise for r in rows)} bitwise, "
               f"{sum(r.outside for r in rows)} outside, {len(unjudged)} not judged"]
    skipped = sorted({g for r in rows if r.judged and not r.bitwise for g in r.errors if not r.judges(g)})
    if skipped:
        details.append(f"{' and '.join(skipped)} not judged at some steps: their band exceeds {DECORRELATED:g} "
                       f"(the storage of the weights rounds the updates away, or runs one rounding apart drift that "
                       f"far); the other group judges those steps")
    if first_diff is not None:
        details.append(f"first difference: step {first_diff}" + (f", first entry {entry}" if entry else "")
                       + " (not bitwise the reference's)")
    details += [f"warning: {w}" for w in warnings]
    if flagged is None and unjudged:
        return _inconclusive(ref, tgt, rows, unjudged[0], basis, details, warnings, first_diff, entry)
    if flagged is None:
        headline = (f"MATCH: all {len(rows)} steps bitwise the reference's" if first_diff is None else
                    f"MATCH: {len(rows)} steps, every step's error within {_short(basis)}")
        return StepVerdict("match", basis, None, headline, details, warnings, None, first_diff, entry,
                           num_steps=len(rows))
    why = "NaN/Inf on one side only" if flagged.nonfinite else \
        f"the error of its {flagged.by} {flagged.error:.2e} is {flagged.ratio:.1f}x {_short(basis)} {flagged.band:.2e}"
    headline = f"DIVERGED at step {flagged.step}: {why}"
    earlier = [r.step for r in unjudged if r.step < flagged.step]
    if earlier:
        details.append(f"steps {_listed(earlier)} before it were not judged (their band exceeds {DECORRELATED:g}): "
                       f"the first step that went wrong may be one of them")
    commands = _commands(ref, tgt, flagged.step)
    if commands:
        details.append(f"record step {flagged.step} in full on both sides, then compare them (the layer is named):")
        details += [f"  {c}" for c in commands]
    else:
        details.append(f"record step {flagged.step} in full on both sides: oneiter.Recorder around iteration "
                       f"{flagged.step} of the reference's loop (after {flagged.step} plain iterations), then the "
                       f"target's with replay= that file; oneiter compare names the layer")
    return StepVerdict("diverged", basis, flagged.step, headline, details, warnings, commands, first_diff, entry,
                       num_steps=len(rows))


def _inconclusive(ref, tgt, rows: list[StepRow], first: StepRow, basis: str, details: list[str],
                  warnings: list[str], first_diff, entry) -> StepVerdict:
    """No step outside the band, but steps from `first` on not judged (their band exceeds `DECORRELATED`)."""
    before = [r.step for r in rows if r.step < first.step]
    shown = "" if not before else f"step {before[0]} within {_short(basis)}, then " if len(before) == 1 else \
        f"steps {before[0]}-{before[-1]} within {_short(basis)}, then "
    drift = min(b for b in first.bands.values() if b is not None) / BAND_FACTOR
    headline = (f"INCONCLUSIVE from step {first.step}: {shown}the band exceeds {DECORRELATED:g}: runs one rounding "
                f"apart drift {drift:.1%} apart by step {first.step}, so a step's own error can no longer be told "
                f"from what it inherited")
    commands = _commands(ref, tgt, first.step)
    details.append(f"judge a later step on its own: record it in full on both sides (step {first.step} here; any "
                   f"step S the same way, with --step S), then compare them" + (":" if commands else ""))
    details += [f"  {c}" for c in commands or []]
    return StepVerdict("inconclusive", basis, None, headline, details, warnings, commands, first_diff, entry,
                       num_steps=len(rows))


def _listed(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 1 else \
        ", ".join(map(str, steps))


def _short(basis: str) -> str:
    return "the band" if basis == "band" else "the tolerance"


def _commands(ref: IterationFile, tgt: IterationFile, step: int) -> Optional[list[str]]:
    """`oneiter record --step S` of the reference and `record --replay` of it by the target, when both files say how
    they were built (a model spec: a built-in name or a model file), else None."""
    from oneiter import models  # the registry imports mmengine: only when a verdict names a step

    first_ref, first_tgt = ref.step(ref.steps()[0]), tgt.step(tgt.steps()[0])
    spec = str(first_ref.meta.get("model") or "")
    if not (is_file_spec(spec) or spec in dict(models.list_models())):
        return None
    ref_out = _beside(ref.path, step)
    tgt_out = _beside(tgt.path, step)
    args = json_args(first_ref.meta.get("model_args"))
    reference = ["oneiter", "record", "--model", spec, "--step", str(step), *_build(first_ref.meta), *args,
                 *_run(first_ref.meta), "-o", str(ref_out)]
    target = ["oneiter", "record", "--replay", str(ref_out), "--model", spec, *args, *_run(first_tgt.meta),
              "-o", str(tgt_out)]
    return [shlex.join(reference), shlex.join(target)]


def json_args(text) -> list[str]:
    """`--model-arg KEY=VALUE` for each entry of a recording's `model_args` (JSON)."""
    try:
        values = json.loads(text or "{}")
    except ValueError:
        return []
    return [item for key, value in sorted(values.items()) for item in ("--model-arg", f"{key}={value}")]


def _build(meta: dict) -> list[str]:
    out = []
    if meta.get("batch_size"):
        out += ["--batch-size", str(meta["batch_size"])]
    if isinstance(meta.get("rng_seed"), int):
        out += ["--seed", str(meta["rng_seed"])]
    if meta.get("optimizer") in ("sgd", "adamw"):
        out += ["--optimizer", str(meta["optimizer"])]
    return out


def _run(meta: dict) -> list[str]:
    """How a side ran: device, precision, threads, and (a target) its faults and op fallback."""
    out = ["--device", str(meta.get("device") or "cpu")]
    if meta.get("dtype") and meta["dtype"] != "float32":
        out += ["--dtype", str(meta["dtype"])]
    if meta.get("amp"):
        out += ["--amp", str(meta["amp"])]
    if meta.get("num_threads"):
        out += ["--threads", str(meta["num_threads"])]
    for fault in _json_list(meta.get("faults")):
        out += ["--inject-fault", str(fault)]
    fallback = _json_list(meta.get("fallback"))
    if fallback:
        out += ["--fallback", ",".join(map(str, fallback))]
    return out


def _json_list(text) -> list:
    try:
        value = json.loads(text or "[]")
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def _beside(path: Path, step: int) -> Path:
    """`ref.h5` -> `ref.step6.h5`, beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.step{step}{path.suffix or '.h5'}")


def _meta(f: IterationFile) -> dict[str, Any]:
    first = f.step(f.steps()[0]).meta
    merged = {**first, **f.meta}
    return {k: merged[k] for k in META_KEYS if k in merged}

