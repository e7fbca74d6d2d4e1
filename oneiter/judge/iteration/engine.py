"""The comparison engine behind `oneiter compare`: two recordings in, one row per entry and a verdict out.

Sits between the file reader (`oneiter.format.layout.IterationFile`, the only code that knows the HDF5 layout) and the
presentation (`oneiter.report`, the CLI). Steps:

1. open both files and refuse pairs that cannot be compared (another model, other parameter names; `pairing.py`);
2. pair entries by (module path, call index, phase, tensor name) — never by position, so one extra call on one
   side shows up as a missing entry instead of shifting every later pair;
3. put the pairs in causal order: forward in capture order, backward in the order gradients were computed, then
   parameter gradients, then updated parameters (`pairing.causal_pairs`);
4. read each pair once, streaming (one pair of tensors in memory at a time; a dataset hard-linked under two names
   is judged once), and compute `metrics.Metrics` with the tolerance the policy gives (`tolerance.py`);
5. blame (`blame.py`) judges each call's own error where the target recorded local data, and the verdict
   (`verdict.py`) is decided once from all of it: the culprit, or the first row, in that order, that is not a
   match.

Each step returns what it finds (`_compare_open` the measured result, `_read_local` the target's local data,
`_culprit` the culprit's finding and chain, `_unattributed` what no probe explains, `_rounding`, `_nan_origin`);
`_blame` builds the judged result from them by keyword (`dataclasses.replace`), nothing is filled in afterwards.

Row statuses (`entries.py`) are set here, drift and rounding settled by `verdict.py`. Stored dtypes may differ
without a dtype_mismatch only when the two runs were made in different precisions on purpose (meta `dtype`/`amp`
differ): the values are then compared in float64 with the tolerance of the lower-precision dtype.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from dataclasses import replace
from typing import Any, NamedTuple, Optional

import numpy as np

from oneiter.errors import FormatError
from oneiter.format.layout import Entry, IterationFile, reading
from oneiter.format.optimizer_state import OPTIMIZER_STATE, updates_not_judged
from oneiter.format.schema import (
    FOREIGN_KERNELS,
    LOCAL,
    LOSS,
    MICROBATCHES,
    PRECISION_MODES,
    REDUCED_CALLS,
    REDUCED_CALLS_REFERENCE,
    REDUCED_REFERENCE,
    REDUCED_TARGET,
    ROOT_MODULE,
    STATE_AFTER,
    STATE_BEFORE,
    STEP_GRADS,
    STEP_START,
    UNBOUNDED,
    split_call_key,
)
from oneiter.judge.iteration.blame import (
    Sources,
    culprit_chain,
    find_culprit,
    local_results,
    loss_unexplained,
    nan_origin,
    own_values,
    unexplained_rows,
)
from oneiter.judge.iteration.collective_verdict import consumed, step_reduced
from oneiter.judge.iteration.entries import MEASURED, NOT_JUDGED, Key, LocalResult, Row
from oneiter.judge.iteration.findings import Finding, row_findings
from oneiter.judge.iteration.impact import read_impact
from oneiter.judge.iteration.pairing import causal_pairs, check_compatible, check_replay, hidden, positions
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.sentences import STATS_REASON, calibration_reason, culprit_reason
from oneiter.judge.iteration.verdict import settled_rows
from oneiter.judge.measure.metrics import Metrics, compare_arrays
from oneiter.judge.measure.stat_metrics import compare_stats
from oneiter.judge.measure.tolerance import DtypeTolerance, NoisePolicy, Tolerance, TolerancePolicy, looser
from oneiter.runtime.precision import amp_dtype_name
from oneiter.runtime.precision_modes import from_attr, reduced
from oneiter.runtime.sharding import grads_reduced

__all__ = ["compare_files", "compare_local", "reading", "dataset_id"]

# recording metadata copied into results (JSON `meta`): enough to tell what ran where
META_KEYS = ("model", "device", "device_name", "dtype", "amp", "float8", "num_threads", "seed", "batch_size",
             "optimizer", "faults", "torch_version", "oneiter_version", "world_size", "grad_reduction", MICROBATCHES)


def _run_precision(meta: dict) -> tuple:
    return (meta.get("dtype") or "", meta.get("amp") or "", meta.get("float8") or "")


# -- one row --------------------------------------------------------------------------------------------------------
class _Judge:
    """Turns one (reference, target) pair into a Row; remembers metrics of hard-linked datasets."""

    def __init__(self, ref: IterationFile, tgt: IterationFile, policy: TolerancePolicy):
        self.ref, self.tgt, self.policy = ref, tgt, policy
        self.same_precision = _run_precision(ref.meta) == _run_precision(tgt.meta)
        self.cache: dict[tuple, Metrics] = {}
        self.stored: dict[Key, tuple] = {}  # row key -> (reference dataset, target dataset) it compared

    def row(self, re_: Optional[Entry], te: Optional[Entry]) -> Row:
        """The pair's row: missing on one side, of another shape or dtype, or measured."""
        entry = re_ or te
        assert entry is not None  # a pair holds at least one side
        key = Key(*entry.key)
        sides: dict[str, Any] = {}
        if re_ is not None:
            sides.update(shape=self.ref.shape_of(re_.path), dtype=self.ref.dtype_of(re_.path))
        if te is not None:
            sides.update(shape_target=self.tgt.shape_of(te.path), dtype_target=self.tgt.dtype_of(te.path))
        shape, dtype = sides.get("shape"), sides.get("dtype")
        shape_target, dtype_target = sides.get("shape_target"), sides.get("dtype_target")
        if te is None:
            status, reason = "missing_in_target", "only the reference has this entry"
        elif re_ is None:
            status, reason = "missing_in_reference", "only the target has this entry"
        elif shape != shape_target:
            status, reason = "shape_mismatch", f"shape {_shape(shape)} vs {_shape(shape_target)}"
        elif dtype != dtype_target and self.same_precision:
            status, reason = "dtype_mismatch", f"dtype {dtype} vs {dtype_target}"
        else:
            return Row(**key._asdict(), **sides, **self._measure(key, re_, te, sides["dtype"], sides["dtype_target"]))
        return Row(**key._asdict(), status=status, reason=reason, **sides)

    def _measure(self, key: Key, re_: Entry, te: Entry, dtype: str, dtype_target: str) -> dict[str, Any]:
        """A pair both sides hold alike: its tolerance, metrics, status and reason (a Row's keywords)."""
        tol = self.policy(re_, dtype)
        if dtype_target != dtype:
            tol = looser(tol, self.policy(te, dtype_target))
        # a dataset hard-linked under two names (a layer's output is the next one's input) is judged once
        ident = (dataset_id(self.ref, re_.path), dataset_id(self.tgt, te.path), tol.atol, tol.rtol)
        self.stored[key] = ident[:2]
        metrics = self.cache.get(ident)
        if metrics is None:
            if self.ref.is_stats(re_.path) or self.tgt.is_stats(te.path):  # `--level stats` on either side
                metrics = compare_stats(self.ref.stats_of(re_.path), self.tgt.stats_of(te.path), atol=tol.atol,
                                        rtol=tol.rtol)
            else:
                metrics = compare_arrays(self.ref.read(re_.path), self.tgt.read(te.path), atol=tol.atol,
                                         rtol=tol.rtol)
            self.cache[ident] = metrics
        status, reason = ("diverged", _reason(metrics, tol)) if metrics.diverged else ("match", "")
        return {"status": status, "reason": reason, "tolerance": tol, "metrics": metrics}


def dataset_id(f: IterationFile, path: str):
    """Identity of the stored dataset, equal for hard links (h5py ObjectIDs compare by object)."""
    return f.dataset_id(path)


def _shape(shape: Optional[tuple]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")" if shape is not None else "-"


def _reason(m: Metrics, tol: Tolerance) -> str:
    if math.isnan(m.max_abs) and m.num_out:  # judged from `--level stats` statistics
        return (f"{STATS_REASON}: the L2 norm or sum of |x| differs by {m.rel_l2:.2e} relative, above rtol "
                f"{tol.rtol:.1e} (the elementwise error and local blame need a full recording)")
    parts = []
    if m.num_out:
        parts.append(
            f"{m.num_out} of {m.num_elements} elements ({m.frac_out:.2%}) outside atol={tol.atol:.1e} "
            f"rtol={tol.rtol:.1e}"
        )
    if m.nonfinite_differs:
        parts.append(f"NaN {m.num_nan_ref} vs {m.num_nan_target}, Inf {m.num_inf_ref} vs {m.num_inf_target}")
    return "; ".join(parts)


# -- entry point ----------------------------------------------------------------------------------------------------
def compare_files(
    ref_path: str | os.PathLike,
    tgt_path: str | os.PathLike,
    *,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    tolerance: Optional[TolerancePolicy] = None,
    noise: Optional[NoisePolicy] = None,
) -> CompareResult:
    """Compare two recordings entry by entry; `tolerance` (a policy) replaces the dtype defaults + rtol/atol,
    `noise` sets how far above its expected noise a layer's local error may go."""
    policy = _policy(tolerance, atol, rtol)
    with reading(ref_path, tgt_path), contextlib.ExitStack() as stack:
        ref = stack.enter_context(IterationFile(ref_path))
        tgt = stack.enter_context(IterationFile(tgt_path))
        return _blame(_compare_open(ref, tgt, policy), ref, tgt, policy, noise or NoisePolicy())


def _policy(tolerance: Optional[TolerancePolicy], atol: Optional[float], rtol: Optional[float]) -> TolerancePolicy:
    """The caller's policy, else the dtype defaults with --atol/--rtol applied."""
    return tolerance if tolerance is not None else DtypeTolerance(atol=atol, rtol=rtol)


def compare_local(
    path: str | os.PathLike,
    *,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    tolerance: Optional[TolerancePolicy] = None,
    noise: Optional[NoisePolicy] = None,
) -> CompareResult:
    """Judge one `record --against cpu` recording on its own: each layer against its float32 CPU recomputation.

    `rtol`, `atol` and `tolerance` are checked as `compare_files` checks them (a negative one is refused), but such
    a file holds no pairs of accumulated tensors to hold to them (its loss has no reference either)."""
    _policy(tolerance, atol, rtol)
    with reading(path), IterationFile(path) as tgt:
        if tgt.local_kind() != "against_cpu":
            raise FormatError(
                f"'{path}' alone cannot be judged: record it with --against cpu, or compare it with a reference"
            )
        local = _read_local(tgt, noise or NoisePolicy())
        rows = [Row(**r.row_key._asdict(), status="diverged" if r.flagged else "match", dtype=r.dtype,
                    dtype_target=r.dtype, metrics=r.metrics.as_metrics()) for r in local.results]
        counts = {entry.key: _nonfinite_count(tgt.read(entry.path)) for entry in tgt.entries()
                  if entry.phase in ("forward", "backward")}
        culprit = _culprit(local, rows)
        # its rows are the local results themselves: nothing to settle, nothing no probe covers
        return CompareResult(
            reference=str(path), target=str(path), meta_reference=_meta(tgt), meta_target=_meta(tgt), rows=rows,
            first_divergence=None, loss={"target": _loss(tgt)}, **local.fields(), notes=local.notes,
            precision=_precision(None, tgt), chain=culprit.chain, culprit_includes=culprit.includes,
            nan_origin=nan_origin(counts, list(counts)),
            findings=[*culprit.findings, *_calibration_findings(rows, local.results), *row_findings(rows, None, True)],
        )


def _precision(ref: Optional[IterationFile], tgt: IterationFile) -> Optional[dict]:
    """What each side ran reduced (its root attribute `precision_modes`: family -> mode, and whose flags) and what
    the target's calibration reproduced (its /local attributes); None when no side ran anything reduced."""
    sides = {"target": from_attr(tgt.meta.get(PRECISION_MODES))}
    if ref is not None:
        sides["reference"] = from_attr(ref.meta.get(PRECISION_MODES))
    if not any(reduced(m) for m in sides.values()):
        return None
    attrs = tgt.local_attrs() if tgt.has(LOCAL) else {}
    out: dict[str, Any] = {}
    for side, modes in sides.items():
        out[side] = {**reduced(modes), "flags": modes.get("flags") or ""}
    out["calibrated"] = {"target": reduced(from_attr(attrs.get(REDUCED_TARGET))),
                         "target_calls": int(attrs.get(REDUCED_CALLS) or 0),
                         "reference": reduced(from_attr(attrs.get(REDUCED_REFERENCE))),
                         "reference_calls": int(attrs.get(REDUCED_CALLS_REFERENCE) or 0),
                         "where": str(attrs.get("calibrate") or "")}
    return out


def _nonfinite_count(array) -> int:
    import numpy as np

    return int(array.size - np.count_nonzero(np.isfinite(array))) if array.dtype.kind in "fc" else 0


def _blame(measured: CompareResult, ref: IterationFile, tgt: IterationFile, policy,
           noise: NoisePolicy) -> CompareResult:
    """The measured comparison with what blame finds (local errors, the culprit and its chain, what no probe
    explains, NaN/Inf and its origin, structural differences) as its findings, and its rows settled by them."""
    local = _read_local(tgt, noise)
    run_dtype = amp_dtype_name(tgt.meta.get("amp")) or str(tgt.meta.get("dtype") or "float32")
    sources = Sources(measured.rows, measured.loss, local.parents, tuple(consumed(ref, tgt)), stored=measured.stored,
                      norm=_reference_norms(ref), run_dtype=run_dtype,
                      stepped_changed=ref.has(STEP_GRADS) or tgt.has(STEP_GRADS))
    own, rounding = _own_values(measured.rows, local, sources, ref, tgt, run_dtype)
    rounding = _rounding(measured, local, rounding)
    culprit = _culprit(local, measured.rows)
    found = culprit.findings or sorted(
        [*own, *_unattributed(measured, local, rounding, ref, tgt, policy, noise, sources)],
        key=lambda f: (f.entry is None, f.entry or 0))
    found = [*found, *_calibration_findings(measured.rows, local.results)]
    evidence = replace(measured, **local.fields(), notes=[*measured.notes, *local.notes],
                       precision=_precision(ref, tgt), rounding=rounding, chain=culprit.chain,
                       culprit_includes=culprit.includes, nan_origin=_nan_origin(measured.rows))
    rows = settled_rows(evidence, found)
    return replace(evidence, rows=rows,
                   findings=[*found, *row_findings(rows, evidence.first_divergence, evidence.has_local)])


def _own_values(rows: list[Row], local: _Local, sources: Sources, ref: IterationFile, tgt: IterationFile,
                run_dtype: str) -> tuple[list[Finding], set[int]]:
    """Of a teacher-forced replay: the local rows computed from values all bitwise the reference's that disagree
    with their accumulated row (`blame.own_values`: findings), and those that agree (their own rounding)."""
    if local.kind != "teacher_forced":
        return [], set()
    return own_values(
        rows, local.results, sources, on_cpu=str(tgt.meta.get("device") or "cpu").startswith("cpu"),
        run_dtype=run_dtype, world_size=int(tgt.meta.get("world_size") or 1) if grads_reduced(tgt.meta) else 1,
        update_scale=functools.partial(_update_scale, ref))


def _rounding(measured: CompareResult, local: _Local, own: set[int]) -> set[int]:
    """The rows that are rounding: their own call's (`own`), and those whose value its precision cannot resolve
    (its local row's expected noise is as large as it: `LocalResult.rounding`); the same tensor under another name
    (the next call's input) is the same rounding."""
    by_row = {r.row_key: r for r in local.results}
    rounding = own | {i for i, row in enumerate(measured.rows) if row.status in ("match", "diverged")
                      and row.metrics is not None and row.metrics.rel_l2 > 0
                      and getattr(by_row.get(row.key), "rounding", False)}
    if not rounding:
        return rounding
    same = {measured.stored[i] for i in rounding}
    return {i for i, ident in enumerate(measured.stored) if ident is not None and ident in same}


def _nan_origin(rows: list[Row]) -> Optional[dict]:
    """Where NaN/Inf first appear in the target (`blame.nan_origin`), when any row's differ from the reference's."""
    if not any(row.metrics is not None and row.metrics.nonfinite_differs for row in rows):
        return None
    counts: dict[tuple[str, int, str, str], int] = {
        row.key: row.metrics.num_nan_target + row.metrics.num_inf_target for row in rows if row.metrics is not None}
    return nan_origin(counts, list(counts))


def _reference_norms(ref: IterationFile):
    """key -> the L2 norm of the reference's entry (its statistics: computed from a full entry, stored at the
    statistics level), read on first use; None for an entry the reference lacks."""
    paths = {e.key: e.path for e in ref.entries() if e.phase in ("forward", "backward")}

    @functools.lru_cache(maxsize=None)
    def norm(key: tuple) -> Optional[float]:
        path = paths.get(key)
        return None if path is None else float(ref.stats_of(path)["l2"])

    return norm


class _Local(NamedTuple):
    """The target's local data: its kind ("" without), each tensor judged, the calls no probe reran, what the
    recording says about its calibration, and each call's parent call."""

    kind: str
    results: list[LocalResult]
    unprobed: list[dict]
    notes: list[str]
    parents: dict

    def fields(self) -> dict[str, Any]:
        """What a `CompareResult` holds of it (its notes join the comparison's own)."""
        return {"local_kind": self.kind, "local": self.results, "unprobed": self.unprobed}


def _read_local(tgt: IterationFile, noise: NoisePolicy) -> _Local:
    """The target's local data (`_Local`)."""
    if tgt.local_kind() and not tgt.has(LOCAL):  # the recorder always writes the table (maybe empty) with the attr
        raise FormatError(f"'{tgt.path}' says it holds per-call local data (local = '{tgt.local_kind()}') but its "
                          f"/local table is missing: the file is damaged; record the target again")
    kind = tgt.local_kind() if tgt.has(LOCAL) else ""
    results = local_results(tgt, noise) if kind else []
    notes = [*foreign_notes(tgt.local_attrs()), *unbounded_notes(tgt.local_attrs())] if kind else []
    unprobed = [{"module": m, "call": c, "reason": why} for m, c, why in tgt.unprobed()]
    parents = {}
    for _key, attrs in tgt.calls():
        module, call = attrs.get("module") or ROOT_MODULE, int(attrs.get("call", 0))
        parent = str(attrs.get("parent") or "")
        parents[(module, call)] = _call_of(parent) if parent else None
    return _Local(kind=kind, results=results, unprobed=unprobed, notes=notes, parents=parents)


class _Culprit(NamedTuple):
    """The `culprit` finding (none: no local result is flagged), its chain and the unprobed calls its rerun
    included."""

    findings: list[Finding]
    chain: list[dict]
    includes: list[dict]


def _culprit(local: _Local, rows: list[Row]) -> _Culprit:
    """The first flagged local result as the `culprit` finding, with its row (None: the report has none)."""
    culprit = find_culprit(local.results)
    if culprit is None:
        return _Culprit(findings=[], chain=[], includes=[])
    index = next((i for i, r in enumerate(rows) if r.key == culprit.row_key), None)
    return _Culprit(findings=[Finding.of("culprit", index, culprit_reason(culprit), culprit)],
                    chain=culprit_chain(culprit, local.parents, local.results),
                    includes=_included(culprit, local.parents, local.unprobed))


def _unattributed(measured: CompareResult, local: _Local, rounding: set[int], ref: IterationFile,
                  tgt: IterationFile, policy, noise: NoisePolicy, sources: Sources) -> list[Finding]:
    """With no call to blame: the entries no probe covers and the loss, where the precision does not explain
    them; without local data, the loss outside its tolerance. Calls with nothing of their own to judge (their
    outputs are their inputs) are held to their inputs like unprobed ones."""
    if not local.kind:
        return _loss_outside(measured.loss, policy, _loss_dtype(tgt))
    same = _run_precision(ref.meta) == _run_precision(tgt.meta)
    unprobed = {(u["module"], u["call"]) for u in local.unprobed} | tgt.pass_through_calls()
    if not tgt.meta.get("random_replay", True):  # random ops drew this run's own values: not judged locally
        unprobed |= {(a.get("module") or ROOT_MODULE, int(a.get("call", 0))) for _, a in tgt.calls()
                     if int(a.get("random_end", 0) or 0) > int(a.get("random_begin", 0) or 0)}
    covered = {r.key for r in local.results if r.phase in ("param_grad", "optimizer")}
    rows = measured.rows
    if grads_reduced(tgt.meta):  # averaged over ranks (grad_reduction): not this rank's own numbers
        covered |= {r.key for r in rows if r.phase == "param_grad"}
        covered |= {r.key for r in rows if r.phase == "optimizer" and r.key.param_grad in covered}
    if step_reduced(ref, tgt):  # the step's own collectives (tensor-parallel gradients) differ: judged across ranks
        covered |= {r.key for r in rows if r.phase == "optimizer"}
    found = unexplained_rows(rows, unprobed, noise, same_precision=same, loss=measured.loss, covered=covered,
                             amp=amp_dtype_name(tgt.meta.get("amp")), sources=sources, rounding=rounding)
    return found + loss_unexplained(measured.loss, rows, noise, same, _loss_dtype(tgt))


def _loss_outside(loss: dict[str, Optional[float]], policy, dtype: str) -> list[Finding]:
    """Without local data the loss is judged like any entry: outside its dtype's tolerance (or NaN on one side only)
    is a divergence even when every recorded tensor matches (the loss function is code outside the model)."""
    a, b = loss.get("reference"), loss.get("target")
    if a is None or b is None or a == b or (math.isnan(a) and math.isnan(b)):
        return []
    tol = policy(Entry("", 0, "loss", "loss", LOSS, 0), dtype)
    if math.isnan(a) or math.isnan(b) or abs(a - b) > tol.atol + tol.rtol * abs(a):
        return [Finding.of("loss", None, f"the loss differs: {a:.6e} vs {b:.6e}, outside atol {tol.atol:.1e} rtol "
                                         f"{tol.rtol:.1e} ({dtype})")]
    return []


def _update_scale(ref: IterationFile, module: str, tensor: str) -> float:
    """||after|| / ||after - before|| of the reference's parameter `module.tensor` (inf: it did not move); `before`
    is where its step started (`/step_start` for a parameter the model wrote itself, else `state_before`)."""
    name = tensor if module == ROOT_MODULE else f"{module}.{tensor}"
    before = ref.state(STEP_START).get(name) or ref.state(STATE_BEFORE).get(name)
    after = ref.state(STATE_AFTER).get(name)
    if before is None or after is None or ref.is_stats(before) or ref.is_stats(after):
        return math.inf
    a, b = ref.read(after).astype(np.float64), ref.read(before).astype(np.float64)
    update = float(np.linalg.norm(a - b))
    return float(np.linalg.norm(a)) / update if update else math.inf


def _calibration_findings(rows: list[Row], local: list[LocalResult]) -> list[Finding]:
    """A `calibration` finding for every local row whose calibrated noise was not trusted and that is not flagged
    (a flagged one is judged against what its precision can produce, and may be the culprit), in causal order."""
    index = {r.key: i for i, r in enumerate(rows)}
    return [Finding.of("calibration", index.get(r.row_key), calibration_reason(r), r) for r in local
            if r.untrusted and not r.flagged]


def foreign_notes(attrs: dict) -> list[str]:
    """What the recording says about the kernels its calibration ran that were not torch's own (`FOREIGN_KERNELS`,
    written by `record/local/probe.py`), in words: every report states them."""
    try:
        found = json.loads(str(attrs.get(FOREIGN_KERNELS) or "{}"))
    except ValueError:
        return []
    notes = []
    for entry in found.get("cpu") or [] if isinstance(found, dict) else []:
        if not isinstance(entry, dict):
            continue
        what = (f"the {entry.get('key')} kernel of {entry.get('op')} is not torch's own (registered at "
                f"{_short(str(entry.get('registered')))})")
        how = (str(entry.get("route")) if entry.get("kind") == "none" else
               f"the calibration ran {entry.get('route')} instead")
        notes.append(f"calibration: {what}: {how}")
    device = found.get("device") if isinstance(found, dict) else None
    if isinstance(device, dict) and str(attrs.get("calibrate")) == "device":
        if device.get("plugin"):
            notes.append(f"calibration on the device: {device.get('type')} is a PrivateUse1 backend, every kernel "
                         f"is its plugin's: its noise is checked against the trusted CPU's")
        elif device.get("num_ops"):
            names = ", ".join(str(o.get("op")) for o in device.get("ops", [])[:3] if isinstance(o, dict))
            notes.append(f"calibration on the device: {device.get('num_ops')} ops' {device.get('type')} kernels are "
                         f"not torch's own ({names}): its noise is checked against the trusted CPU's")
    return notes


def unbounded_notes(attrs: dict) -> list[str]:
    """What the recording says about the noise bounds its calibration needed and could not measure (`UNBOUNDED`,
    written by `record/local/probe.py`), in words: a calibrated noise above the gate is used unchecked there."""
    try:
        found = json.loads(str(attrs.get(UNBOUNDED) or "[]"))
    except ValueError:
        return []
    found = [f for f in found if isinstance(f, dict)] if isinstance(found, list) else []
    if not found:
        return []
    shown = "; ".join(f"{f.get('what')}: {f.get('reason')}" for f in found[:3])
    more = f"; {len(found) - 3} more" if len(found) > 3 else ""
    return [f"calibration: the noise bound (what the precision can produce, which checks a calibrated noise) could "
            f"not be measured for {len(found)} calls or parameters, whose calibrated noise is used unchecked: "
            f"{shown}{more}"]


def _short(where: str) -> str:
    """A registration's place relative to the working folder when under it, else as recorded."""
    try:
        relative = os.path.relpath(where)
    except ValueError:
        return where
    return where if relative.startswith("..") else relative


def _included(culprit: LocalResult, parents: dict, unprobed: list[dict]) -> list[dict]:
    """Unprobed calls that ran live inside the culprit's rerun (their unprobed ancestors lead up to it)."""
    failed = {(u["module"], u["call"]): u for u in unprobed}
    found = []
    for key, entry in failed.items():
        at, seen = parents.get(key), {key}
        while at is not None and at in failed and at not in seen:  # the file's parents form a tree (validated)
            seen.add(at)
            at = parents.get(at)
        if at == (culprit.module, culprit.call):
            found.append(entry)
    return found


def _call_of(key: str) -> tuple[str, int]:
    module, call = split_call_key(key)
    return (module or ROOT_MODULE, call)


def _loss_dtype(f: IterationFile) -> str:
    return f.dtype_of(LOSS) if f.has(LOSS) else "float32"


def _compare_open(ref: IterationFile, tgt: IterationFile, policy: TolerancePolicy) -> CompareResult:
    check_compatible(ref, tgt)
    note = check_replay(ref, tgt)
    pairs = causal_pairs(list(ref.entries()), list(tgt.entries()), positions(ref), positions(tgt))
    pairs, compiled = hidden(pairs, ref, tgt)
    if not pairs:
        raise FormatError(f"'{ref.path}' and '{tgt.path}' hold no entries to compare")
    judge = _Judge(ref, tgt, policy)
    rows = [judge.row(r, t) for r, t in pairs]
    stored = [judge.stored.get(r.key) for r in rows]
    unjudged = _updates_not_judged(ref, tgt)
    rows = _not_judged(rows, unjudged) if unjudged else rows
    # before blame: no drift yet
    first = next((i for i, row in enumerate(rows) if row.status not in ("match", NOT_JUDGED)), None)
    notes = [note] if note and first is not None else []  # two equal recordings need no explaining
    return CompareResult(
        reference=str(ref.path), target=str(tgt.path),
        meta_reference=_meta(ref), meta_target=_meta(tgt),
        rows=rows, first_divergence=first, loss={"reference": _loss(ref), "target": _loss(tgt)},
        notes=notes + ([unjudged] if unjudged else []),
        stored=stored, compiled=compiled, microbatches=tgt.call_microbatches() or ref.call_microbatches(),
        microbatch_loss={side: f.microbatch_losses() for side, f in (("reference", ref), ("target", tgt))
                         if f.microbatch_losses()},
        impact=read_impact(tgt),
    )


def _updates_not_judged(ref: IterationFile, tgt: IterationFile) -> Optional[str]:
    """Why the parameters' updates are not judged: the target's optimizer did not start from the reference's state
    (`format/optimizer_state.py`); None: they are."""
    return updates_not_judged(str(ref.meta.get(OPTIMIZER_STATE) or ""), str(tgt.meta.get(OPTIMIZER_STATE) or ""),
                              str(tgt.meta.get("optimizer") or ""))


def _not_judged(rows: list[Row], why: str) -> list[Row]:
    """The rows with every parameter's measured update row `not_judged`, with the reason."""
    trained = {(r.module, r.tensor) for r in rows if r.phase == "param_grad"}  # parameters (buffers have no grad)
    return [replace(row, status=NOT_JUDGED, reason="its optimizer did not start from the reference's state (see "
                                                   "verdict)")
            if row.phase == "optimizer" and (row.module, row.tensor) in trained and row.status in MEASURED else row
            for row in rows]


def _meta(f: IterationFile) -> dict[str, Any]:
    """The META_KEYS a file has; "" (how the file stores None) back to None."""
    return {k: (None if f.meta[k] == "" else f.meta[k]) for k in META_KEYS if k in f.meta}


def _loss(f: IterationFile) -> Optional[float]:
    if not f.has(LOSS):
        return None
    values = f.read(LOSS).reshape(-1)
    return float(values[0]) if values.size == 1 else None
