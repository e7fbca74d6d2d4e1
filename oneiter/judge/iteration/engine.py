"""The comparison engine behind `oneiter compare`: two recordings in, one row per entry and a verdict out.

Sits between the file reader (`oneiter.format.layout.IterationFile`, the only code that knows the HDF5 layout) and the
presentation (`oneiter.report`, the CLI). Steps:

1. open both files and refuse pairs that cannot be compared (another model, other parameter names);
2. pair entries by (module path, call index, phase, tensor name) — never by position, so one extra call on one
   side shows up as a missing entry instead of shifting every later pair;
3. put the pairs in causal order: forward in capture order, backward in the order gradients were computed, then
   parameter gradients, then updated parameters (`causal_pairs`);
4. read each pair once, streaming (one pair of tensors in memory at a time; a dataset hard-linked under two names
   is judged once), and compute `metrics.Metrics` with the tolerance the policy gives (`tolerance.py`);
5. blame (`blame.py`) judges each call's own error where the target recorded local data, and the verdict
   (`verdict.py`) is decided once from all of it: the culprit, or the first row, in that order, that is not a
   match.

Row statuses: match, diverged, missing_in_target, missing_in_reference, shape_mismatch, dtype_mismatch, and, with
local data, drift (outside tolerance, but the call's own code is within noise: accumulated error) and rounding
(outside tolerance, but computed from values bitwise the reference's: the call's own error, within its noise;
`verdict.py` settles both); not_judged for a parameter's update when the target's optimizer did not start from
the reference's state (`format/optimizer_state.py`: measured and shown, never judged); every other one is a
divergence. Stored dtypes may differ without a dtype_mismatch only when the two runs were made in different
precisions on purpose (meta `dtype`/`amp` differ): the values are then compared in float64 with the tolerance of
the lower-precision dtype.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from oneiter.errors import FormatError
from oneiter.format.layout import Entry, IterationFile, reading
from oneiter.format.optimizer_state import LOADED, OPTIMIZER_STATE, updates_not_judged
from oneiter.format.schema import (
    LOCAL,
    LOSS,
    OPTIMIZER,
    PRECISION_MODES,
    REDUCED_CALLS,
    REDUCED_CALLS_REFERENCE,
    REDUCED_REFERENCE,
    REDUCED_TARGET,
    ROOT_MODULE,
    STATE_AFTER,
    STATE_BEFORE,
    natural_key,
    seq_kind,
    split_call_key,
)
from oneiter.judge.iteration.blame import (
    LocalResult,
    NoisePolicy,
    Sources,
    culprit_chain,
    find_culprit,
    local_results,
    loss_unexplained,
    nan_origin,
    own_values,
    unexplained_rows,
)
from oneiter.judge.iteration.findings import MEASURED, NOT_JUDGED, Finding, row_findings
from oneiter.judge.iteration.verdict import (
    STATS_REASON,
    Culprit,
    Verdict,
    culprit_reason,
    decide,
    json_ready,
    settle_rows,
)
from oneiter.judge.measure.metrics import Metrics, compare_arrays
from oneiter.judge.measure.stat_metrics import compare_stats
from oneiter.judge.measure.tolerance import DtypeTolerance, Tolerance, TolerancePolicy, looser
from oneiter.runtime.precision import amp_dtype_name
from oneiter.runtime.precision_modes import from_attr, reduced

__all__ = [
    "PHASES", "STATUSES", "NOT_DIVERGED", "Row", "CompareResult", "compare_files", "causal_pairs", "check_compatible",
    "reading", "dataset_id", "nan_inf_text",
]

PHASES = ("forward", "backward", "param_grad", "optimizer")
STATUSES = ("match", "rounding", "drift", "diverged", NOT_JUDGED, "missing_in_target", "missing_in_reference",
            "shape_mismatch",
            "dtype_mismatch")
NOT_DIVERGED = ("match", "rounding", "drift", NOT_JUDGED)
# recording metadata copied into results (JSON `meta`): enough to tell what ran where
META_KEYS = ("model", "device", "device_name", "dtype", "amp", "num_threads", "seed", "batch_size", "optimizer",
             "faults", "torch_version", "oneiter_version", "world_size", "grad_reduction")


@dataclass
class Row:
    """One entry of the comparison. `shape`/`dtype` are the reference's, `*_target` the target's (None if absent)."""

    module: str
    call: int
    phase: str
    tensor: str
    status: str
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    shape_target: Optional[tuple] = None
    dtype_target: Optional[str] = None
    tolerance: Optional[Tolerance] = None
    metrics: Optional[Metrics] = None
    reason: str = ""

    @property
    def diverged(self) -> bool:
        """A divergence (drift, accumulated error whose calls are each within noise, is not; nor is rounding, a
        call's own error within its noise on values bitwise the reference's; nor an entry not judged)."""
        return self.status not in NOT_DIVERGED

    @property
    def name(self) -> str:
        """`layer1.0.conv1@0 forward output`: how reports name the entry."""
        return f"{self.module}@{self.call} {self.phase} {self.tensor}"

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready (shapes as lists; non-finite floats stay floats, see `CompareResult.to_json`)."""
        data = {
            "module": self.module, "call": self.call, "phase": self.phase, "tensor": self.tensor,
            "status": self.status, "nan_inf": nan_inf_text(self.metrics),
        }
        names = Metrics.__dataclass_fields__
        data.update(self.metrics.as_dict() if self.metrics else {k: None for k in names})
        data.update({
            "atol": self.tolerance.atol if self.tolerance else None,
            "rtol": self.tolerance.rtol if self.tolerance else None,
            "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype,
            "shape_target": None if self.shape_target is None else list(self.shape_target),
            "dtype_target": self.dtype_target, "reason": self.reason,
        })
        return data


def nan_inf_text(m: Optional[Metrics]) -> str:
    """`Inf 0|1`, `NaN 2|2 Inf 0|1`: the NaN and Inf counts, reference|target, of the kinds either side holds;
    "" when neither holds any. Reports show it before the metrics, which only see the finite elements."""
    if m is None:
        return ""
    kinds = (("NaN", m.num_nan_ref, m.num_nan_target), ("Inf", m.num_inf_ref, m.num_inf_target))
    return " ".join(f"{name} {ref}|{tgt}" for name, ref, tgt in kinds if ref or tgt)


@dataclass
class CompareResult:
    """Rows in causal order, the index of the first entry outside tolerance (None: none is), what blame found, and
    the verdict decided from them once (`verdict_obj`, see `judge/iteration/verdict.py`)."""

    reference: str
    target: str
    meta_reference: dict[str, Any]
    meta_target: dict[str, Any]
    rows: list[Row]
    first_divergence: Optional[int]
    loss: dict[str, Optional[float]] = field(default_factory=dict)
    local_kind: str = ""
    """`teacher_forced`, `against_cpu`, or "" (no local data: the verdict falls back to first divergence)."""
    local: list[LocalResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    """Every piece of evidence that the runs diverge (`judge/iteration/findings.py`); the verdict names the
    strongest."""
    chain: list[dict] = field(default_factory=list)
    """The culprit's call and every call containing it, innermost first."""
    culprit_includes: list[dict] = field(default_factory=list)
    """Calls that could not be probed alone and ran inside the culprit's rerun: part of what it is blamed for."""
    nan_origin: Optional[dict] = None
    unprobed: list[dict] = field(default_factory=list)
    """Calls the local probe could not rerun: {module, call, reason}."""
    notes: list[str] = field(default_factory=list)
    """Warnings about the comparison itself (e.g. a tolerance file written for another device)."""
    precision: Optional[dict] = None
    """The reduced-precision float32 modes (TF32...) each side ran, and those the calibration reproduced
    (`_precision`); None when neither side ran any."""
    compiled: Optional[dict] = None
    """The compiled blocks (torch.compile) each side ran, what compiling cost, its graph breaks, and the entries
    the other side recorded inside a block, which are not compared (`_hidden`); None when neither compiled."""
    rounding: set[int] = field(default_factory=set)
    """Rows outside tolerance computed from values all bitwise the reference's, whose error is their own code's
    and within its noise (`blame.own_values`), and every row stored as the same pair of datasets (a layer's output
    is the next one's input): `rounding`, never drift."""
    stored: list = field(default_factory=list, repr=False)
    """Per row, the identity of the pair of datasets it compares (hard links share one); None when unmeasured."""

    @property
    def has_local(self) -> bool:
        return bool(self.local_kind)

    @functools.cached_property
    def verdict_obj(self) -> Verdict:
        """The verdict, decided once from the settled rows; every report renders this one object."""
        return decide(self)

    def verdict(self) -> dict[str, Any]:
        """The verdict as the JSON report holds it (`Verdict.as_dict()`)."""
        return self.verdict_obj.as_dict()

    @property
    def status(self) -> str:
        return self.verdict_obj.status

    @property
    def basis(self) -> str:
        return self.verdict_obj.basis

    @property
    def culprit(self) -> Optional[Culprit]:
        """The call whose own computation is to blame (module, call, phase, tensor, its row, ratio, reason)."""
        return self.verdict_obj.culprit

    @property
    def exit_code(self) -> int:
        """What `oneiter compare` exits with: 0 match, 1 diverged, 2 inconclusive (cannot be judged)."""
        return self.verdict_obj.exit_code

    @property
    def divergence(self) -> Optional[Row]:
        """The accumulated row the verdict names (None on a match, or when the culprit or the loss is named)."""
        index = self.verdict_obj.index
        return None if index is None or self.verdict_obj.focus == "culprit" else self.rows[index]

    def row_dict(self, index: int) -> dict[str, Any]:
        """One row as JSON and CSV hold it: index, key, status, role (what the row is to the verdict), NaN/Inf,
        metrics."""
        data = self.rows[index].as_dict()
        role = " ".join(self.verdict_obj.roles(index))
        head = {k: data.pop(k) for k in ("module", "call", "phase", "tensor", "status")}
        return {"index": index, **head, "role": role, **data}

    def as_dict(self) -> dict[str, Any]:
        """The machine-readable report's data: verdict, inputs, per-status counts and every row in causal order
        with its local result (non-finite numbers still floats: `to_json` is what JSON can hold)."""
        rows = [{**self.row_dict(i), "local": _local_dict(self.local_for(row))} for i, row in enumerate(self.rows)]
        return {
            "verdict": self.verdict(),
            "reference": self.reference,
            "target": self.target,
            "meta": {"reference": self.meta_reference, "target": self.meta_target},
            "loss": self.loss,
            "counts": self.counts(),
            "rows": rows,
        }

    def to_json(self) -> dict[str, Any]:
        """The machine-readable report (`as_dict`, with inf/nan as the strings JSON needs)."""
        return json_ready(self.as_dict())

    def counts(self) -> dict[str, int]:
        """Number of rows per status, every status listed."""
        counts = dict.fromkeys(STATUSES, 0)
        for row in self.rows:
            counts[row.status] += 1
        return counts

    @functools.cached_property
    def _local_index(self) -> dict[tuple, LocalResult]:
        return {r.row_key: r for r in self.local}

    def local_for(self, row: Row) -> Optional[LocalResult]:
        """The local error measured for the same (module, call, phase, tensor) as an accumulated row."""
        return self._local_index.get((row.module, row.call, row.phase, row.tensor))


def _local_dict(local: Optional[LocalResult]) -> Optional[dict[str, Any]]:
    return None if local is None else local.as_dict()


# -- pairing and causal order ---------------------------------------------------------------------------------------
_KIND_RANK = {"input": 0, "output": 1, "grad_output": 0, "grad_input": 1}
_NO_ANCHOR = (-1, 0, 0, ())


def _positions(f: IterationFile) -> dict[tuple[str, int], int]:
    """(module, call) -> execution position."""
    return {(attrs.get("module"), int(attrs.get("call", 0))): i for i, (_, attrs) in enumerate(f.calls())}


def _sort_key(entry: Entry, positions: dict) -> tuple:
    """Causal position of an entry inside its file; ties (tensors captured at one moment) broken by call order."""
    rank = PHASES.index(entry.phase)
    if entry.phase in ("forward", "backward"):
        pos = positions.get((entry.module, entry.call), 0)
        tie = pos if entry.phase == "forward" else -pos  # without seq attrs: backward runs calls in reverse
        kind = _KIND_RANK.get(seq_kind(entry.tensor), 2)
        return (rank, entry.seq, tie, kind, natural_key(entry.tensor))
    return (rank, entry.seq, 0, 0, natural_key(entry.tensor))


def causal_pairs(
    ref_entries: list[Entry], tgt_entries: list[Entry], ref_positions: dict, tgt_positions: dict
) -> list[tuple[Optional[Entry], Optional[Entry]]]:
    """(reference, target) pairs by key, in the reference's causal order.

    An entry only the target has goes right after the target entry that precedes it and the reference also has,
    so it lands where it happened instead of at the end.
    """
    tgt_by_key = {e.key: e for e in tgt_entries}
    ref_keys = {e.key: _sort_key(e, ref_positions) for e in ref_entries}
    ordered = [(ref_keys[e.key] + (0, 0), e, tgt_by_key.get(e.key)) for e in ref_entries]
    anchor, phase = None, None
    for j, entry in enumerate(sorted(tgt_entries, key=lambda e: _sort_key(e, tgt_positions))):
        if entry.phase != phase:
            anchor, phase = (PHASES.index(entry.phase),) + _NO_ANCHOR, entry.phase
        if entry.key in ref_keys:
            anchor = ref_keys[entry.key]
        else:
            ordered.append((anchor + (1, j), None, entry))
    ordered.sort(key=lambda item: item[0])
    return [(r, t) for _, r, t in ordered]


# -- compatibility --------------------------------------------------------------------------------------------------
def check_compatible(ref: IterationFile, tgt: IterationFile) -> None:
    """Raise FormatError when the files record different models or different parameters."""
    model_ref, model_tgt = ref.meta.get("model"), tgt.meta.get("model")
    if _model_id(model_ref) != _model_id(model_tgt):
        raise FormatError(
            f"'{ref.path}' records model '{model_ref}' but '{tgt.path}' records '{model_tgt}': "
            "compare two recordings of the same model"
        )
    for which in (STATE_BEFORE, STATE_AFTER):
        names_ref, names_tgt = set(ref.state(which)), set(tgt.state(which))
        if names_ref and names_tgt and names_ref != names_tgt:
            only_ref, only_tgt = sorted(names_ref - names_tgt), sorted(names_tgt - names_ref)
            example = (only_ref or only_tgt)[0]
            raise FormatError(
                f"'{ref.path}' and '{tgt.path}' hold different parameters ({len(only_ref)} only in the reference, "
                f"{len(only_tgt)} only in the target, e.g. '{example}'): not recordings of the same model"
            )


def check_replay(ref: IterationFile, tgt: IterationFile) -> Optional[str]:
    """A replay must start where the reference started: same optimizer, batch, state_before and (when it loaded
    one) optimizer state (bitwise, after the cast to the target's dtype when it ran in another one). Raise
    FormatError ("bad replay") when it did not — its
    rows would compare two different iterations; return a note when the target is no replay at all."""
    if not tgt.meta.get("replay_of"):
        return (f"'{tgt.path}' is not a replay (recorded without --replay): its weights, batch and random values are "
                f"its own, so entries may differ from the batch on; record the target with --replay {ref.path}")
    opt_ref, opt_tgt = str(ref.meta.get("optimizer") or ""), str(tgt.meta.get("optimizer") or "")
    if opt_ref and opt_tgt and opt_ref != opt_tgt:
        raise FormatError(f"bad replay: the reference ran optimizer '{opt_ref}', the target '{opt_tgt}': a replay "
                          f"must run the reference's optimizer (record --optimizer {opt_ref})")
    ref_batch, tgt_batch = ref.batch_paths(), tgt.batch_paths()
    if len(ref_batch) != len(tgt_batch):
        raise FormatError(f"bad replay: the reference's batch has {len(ref_batch)} tensors, the target's "
                          f"{len(tgt_batch)}: the target did not run on the reference's batch")
    pairs = list(zip(ref_batch, tgt_batch, strict=True))  # lengths checked equal above
    state_ref, state_tgt = ref.state(STATE_BEFORE), tgt.state(STATE_BEFORE)
    pairs += [(state_ref[name], state_tgt[name]) for name in state_ref if name in state_tgt]
    if tgt.meta.get(OPTIMIZER_STATE) == LOADED:  # the optimizer's state it loaded is the reference's too
        opt_ref, opt_tgt = ref.state(OPTIMIZER), tgt.state(OPTIMIZER)
        missing = sorted(set(opt_ref) - set(opt_tgt))
        if missing:
            raise FormatError(f"bad replay: the target's optimizer holds no '{missing[0]}' after loading the "
                              f"reference's state ({len(missing)} of {len(opt_ref)} values missing): its update "
                              f"cannot start where the reference's did")
        pairs += [(opt_ref.get(name, ""), path) for name, path in opt_tgt.items()]
    for ref_path, tgt_path in pairs:
        if not ref_path or not _same_start(ref, tgt, ref_path, tgt_path):
            raise FormatError(
                f"bad replay: the target's {tgt_path} differs from the reference's, so it did not start from this "
                f"reference's weights and batch (was it replayed from another file? its replay_of is "
                f"'{tgt.meta.get('replay_of')}'); record the target again with --replay {ref.path}")
    return None


def _same_start(ref: IterationFile, tgt: IterationFile, ref_path: str, tgt_path: str) -> bool:
    """Whether the target's copy of a reference tensor is the reference's, bit for bit (cast to the target's dtype
    when it differs; statistics files by checksum)."""
    if ref.shape_of(ref_path) != tgt.shape_of(tgt_path):
        return False
    dtype_ref, dtype_tgt = ref.dtype_of(ref_path), tgt.dtype_of(tgt_path)
    if tgt.is_stats(tgt_path) or ref.is_stats(ref_path):
        if dtype_ref != dtype_tgt:
            return True  # a checksum of another dtype proves nothing either way
        mine, theirs = ref.stats_of(ref_path), tgt.stats_of(tgt_path)
        return mine.kind == theirs.kind and mine.checksum == theirs.checksum
    if dtype_ref == dtype_tgt:
        a, b = ref.raw(ref_path), tgt.raw(tgt_path)
        return a.dtype == b.dtype and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                     np.ascontiguousarray(b).view(np.uint8))
    import torch

    cast = ref.tensor(ref_path).to(getattr(torch, dtype_tgt))
    mine = tgt.tensor(tgt_path)
    if cast.dtype != mine.dtype:
        return False
    return bool(cast.view(torch.uint8).equal(mine.contiguous().view(torch.uint8)))


def _model_id(spec) -> str:
    """A model's identity across machines: a built-in name, or `file.py:function` without the file's folder."""
    text = str(spec or "")
    path, sep, func = text.rpartition(":")
    return f"{os.path.basename(path)}:{func}" if sep and path.endswith(".py") else text


def _run_precision(meta: dict) -> tuple:
    return (meta.get("dtype") or "", meta.get("amp") or "")


# -- one row --------------------------------------------------------------------------------------------------------
class _Judge:
    """Turns one (reference, target) pair into a Row; remembers metrics of hard-linked datasets."""

    def __init__(self, ref: IterationFile, tgt: IterationFile, policy: TolerancePolicy):
        self.ref, self.tgt, self.policy = ref, tgt, policy
        self.same_precision = _run_precision(ref.meta) == _run_precision(tgt.meta)
        self.cache: dict[tuple, Metrics] = {}
        self.stored: dict[tuple, tuple] = {}  # row key -> (reference dataset, target dataset) it compared

    def row(self, re_: Optional[Entry], te: Optional[Entry]) -> Row:
        entry = re_ or te
        row = Row(entry.module, entry.call, entry.phase, entry.tensor, "match")
        if re_ is not None:
            row.shape, row.dtype = self.ref.shape_of(re_.path), self.ref.dtype_of(re_.path)
        if te is not None:
            row.shape_target, row.dtype_target = self.tgt.shape_of(te.path), self.tgt.dtype_of(te.path)
        if te is None:
            row.status, row.reason = "missing_in_target", "only the reference has this entry"
        elif re_ is None:
            row.status, row.reason = "missing_in_reference", "only the target has this entry"
        elif row.shape != row.shape_target:
            row.status, row.reason = "shape_mismatch", f"shape {_shape(row.shape)} vs {_shape(row.shape_target)}"
        elif row.dtype != row.dtype_target and self.same_precision:
            row.status, row.reason = "dtype_mismatch", f"dtype {row.dtype} vs {row.dtype_target}"
        else:
            self._measure(row, re_, te)
        return row

    def _measure(self, row: Row, re_: Entry, te: Entry) -> None:
        tol = self.policy(re_, row.dtype)
        if row.dtype_target != row.dtype:
            tol = looser(tol, self.policy(te, row.dtype_target))
        row.tolerance = tol
        # a dataset hard-linked under two names (a layer's output is the next one's input) is judged once
        key = (dataset_id(self.ref, re_.path), dataset_id(self.tgt, te.path), tol.atol, tol.rtol)
        self.stored[(row.module, row.call, row.phase, row.tensor)] = key[:2]
        metrics = self.cache.get(key)
        if metrics is None:
            if self.ref.is_stats(re_.path) or self.tgt.is_stats(te.path):  # `--level stats` on either side
                metrics = compare_stats(self.ref.stats_of(re_.path), self.tgt.stats_of(te.path), atol=tol.atol,
                                        rtol=tol.rtol)
            else:
                metrics = compare_arrays(self.ref.read(re_.path), self.tgt.read(te.path), atol=tol.atol,
                                         rtol=tol.rtol)
            self.cache[key] = metrics
        row.metrics = metrics
        if metrics.diverged:
            row.status, row.reason = "diverged", _reason(metrics, tol)


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
        result = _compare_open(ref, tgt, policy)
        _blame(result, ref, tgt, policy, noise or NoisePolicy())
        return result


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
        result = CompareResult(str(path), str(path), _meta(tgt), _meta(tgt), [], None, {"target": _loss(tgt)})
        parents = _read_local(result, tgt, noise or NoisePolicy())
        result.precision = _precision(None, tgt)
        result.rows = [
            Row(r.row_key[0], r.row_key[1], r.phase, r.row_key[3], "diverged" if r.flagged else "match",
                dtype=r.dtype, dtype_target=r.dtype, metrics=r.metrics.as_metrics())
            for r in result.local
        ]
        counts = {}
        for entry in tgt.entries():
            if entry.phase in ("forward", "backward"):
                counts[entry.key] = _nonfinite_count(tgt.read(entry.path))
        result.nan_origin = nan_origin(counts, list(counts))
        # its rows are the local results themselves: nothing to settle, nothing no probe covers
        result.findings = [*_culprit(result, parents), *row_findings(result.rows, None, True)]
        return result


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


def _blame(result: CompareResult, ref: IterationFile, tgt: IterationFile, policy, noise: NoisePolicy) -> None:
    """Record what blame finds (local errors, the culprit and its chain, what no probe explains, NaN/Inf and its
    origin, structural differences) as the result's findings, and settle the rows' statuses by them."""
    parents = _read_local(result, tgt, noise)
    result.precision = _precision(ref, tgt)
    sources = Sources(result.rows, result.loss, parents)
    own: list[Finding] = []
    if result.local_kind == "teacher_forced":
        own, result.rounding = own_values(
            result.rows, result.local, sources, on_cpu=str(tgt.meta.get("device") or "cpu").startswith("cpu"),
            run_dtype=amp_dtype_name(tgt.meta.get("amp")) or str(tgt.meta.get("dtype") or "float32"),
            world_size=int(tgt.meta.get("world_size") or 1), update_scale=functools.partial(_update_scale, ref))
    if result.rounding:  # the same tensor under another name (the next call's input) is the same rounding
        same = {result.stored[i] for i in result.rounding}
        result.rounding = {i for i, ident in enumerate(result.stored) if ident is not None and ident in same}
    found = _culprit(result, parents)
    if not found:
        found = sorted([*own, *_unattributed(result, ref, tgt, policy, noise, sources)],
                       key=lambda f: (f.entry is None, f.entry or 0))
    counts = {}
    for row in result.rows:
        if row.metrics is not None:
            key = (row.module, row.call, row.phase, row.tensor)
            counts[key] = row.metrics.num_nan_target + row.metrics.num_inf_target
    if any(row.metrics is not None and row.metrics.nonfinite_differs for row in result.rows):
        result.nan_origin = nan_origin(counts, list(counts))
    settle_rows(result, found)
    result.findings = [*found, *row_findings(result.rows, result.first_divergence, result.has_local)]


def _read_local(result: CompareResult, tgt: IterationFile, noise: NoisePolicy) -> dict:
    """The target's local data into the result (its kind, each tensor judged, the calls no probe reran); returns
    each call's parent call."""
    if tgt.local_kind() and not tgt.has(LOCAL):  # the recorder always writes the table (maybe empty) with the attr
        raise FormatError(f"'{tgt.path}' says it holds per-call local data (local = '{tgt.local_kind()}') but its "
                          f"/local table is missing: the file is damaged; record the target again")
    result.local_kind = tgt.local_kind() if tgt.has(LOCAL) else ""
    result.local = local_results(tgt, noise) if result.local_kind else []
    result.unprobed = [{"module": m, "call": c, "reason": why} for m, c, why in tgt.unprobed()]
    parents = {}
    for _key, attrs in tgt.calls():
        module, call = attrs.get("module") or ROOT_MODULE, int(attrs.get("call", 0))
        parent = str(attrs.get("parent") or "")
        parents[(module, call)] = _call_of(parent) if parent else None
    return parents


def _culprit(result: CompareResult, parents: dict) -> list[Finding]:
    """The `culprit` finding (the first flagged local result), its chain and the unprobed calls its rerun
    included; none when no local result is flagged."""
    culprit = find_culprit(result.local)
    if culprit is None:
        return []
    result.chain = culprit_chain(culprit, parents, result.local)
    result.culprit_includes = _included(culprit, parents, result.unprobed)
    index = next((i for i, r in enumerate(result.rows) if (r.module, r.call, r.phase, r.tensor) == culprit.row_key),
                 None)
    return [Finding.of("culprit", index, culprit_reason(culprit), culprit)]


def _unattributed(result: CompareResult, ref: IterationFile, tgt: IterationFile, policy,
                  noise: NoisePolicy, sources: Sources) -> list[Finding]:
    """With no call to blame: the entries no probe covers and the loss, where the precision does not explain
    them; without local data, the loss outside its tolerance. Calls with nothing of their own to judge (their
    outputs are their inputs) are held to their inputs like unprobed ones."""
    if not result.local_kind:
        return _loss_outside(result.loss, policy, _loss_dtype(tgt))
    same = _run_precision(ref.meta) == _run_precision(tgt.meta)
    unprobed = {(u["module"], u["call"]) for u in result.unprobed} | tgt.pass_through_calls()
    if not tgt.meta.get("random_replay", True):  # random ops drew this run's own values: not judged locally
        unprobed |= {(a.get("module") or ROOT_MODULE, int(a.get("call", 0))) for _, a in tgt.calls()
                     if int(a.get("random_end", 0) or 0) > int(a.get("random_begin", 0) or 0)}
    covered = {r.key for r in result.local if r.phase in ("param_grad", "optimizer")}
    if int(tgt.meta.get("world_size") or 1) > 1:  # averaged over ranks (grad_reduction): not this rank's own numbers
        covered |= {(r.module, r.call, r.phase, r.tensor) for r in result.rows if r.phase == "param_grad"}
        covered |= {(r.module, r.call, r.phase, r.tensor) for r in result.rows
                    if r.phase == "optimizer" and (r.module, 0, "param_grad", r.tensor) in covered}
    found = unexplained_rows(result.rows, unprobed, noise, same_precision=same, loss=result.loss, covered=covered,
                             amp=amp_dtype_name(tgt.meta.get("amp")), sources=sources)
    return found + loss_unexplained(result.loss, result.rows, noise, same, _loss_dtype(tgt))


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
    """||after|| / ||after - before|| of the reference's parameter `module.tensor` (inf: it did not move)."""
    name = tensor if module == ROOT_MODULE else f"{module}.{tensor}"
    before, after = ref.state(STATE_BEFORE).get(name), ref.state(STATE_AFTER).get(name)
    if before is None or after is None or ref.is_stats(before) or ref.is_stats(after):
        return math.inf
    a, b = ref.read(after).astype(np.float64), ref.read(before).astype(np.float64)
    update = float(np.linalg.norm(a - b))
    return float(np.linalg.norm(a)) / update if update else math.inf


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
    pairs = causal_pairs(list(ref.entries()), list(tgt.entries()), _positions(ref), _positions(tgt))
    pairs, compiled = _hidden(pairs, ref, tgt)
    if not pairs:
        raise FormatError(f"'{ref.path}' and '{tgt.path}' hold no entries to compare")
    judge = _Judge(ref, tgt, policy)
    rows = [judge.row(r, t) for r, t in pairs]
    stored = [judge.stored.get((r.module, r.call, r.phase, r.tensor)) for r in rows]
    unjudged = _updates_not_judged(ref, tgt, rows)
    # before blame: no drift yet
    first = next((i for i, row in enumerate(rows) if row.status not in ("match", NOT_JUDGED)), None)
    notes = [note] if note and first is not None else []  # two equal recordings need no explaining
    return CompareResult(
        reference=str(ref.path), target=str(tgt.path),
        meta_reference=_meta(ref), meta_target=_meta(tgt),
        rows=rows, first_divergence=first, loss={"reference": _loss(ref), "target": _loss(tgt)},
        notes=notes + ([unjudged] if unjudged else []),
        stored=stored, compiled=compiled,
    )


def _hidden(pairs: list, ref: IterationFile, tgt: IterationFile) -> tuple[list, Optional[dict]]:
    """The pairs to compare, and what each side compiled: an entry one side holds of a call that runs inside a
    compiled block of the other side (whose modules there run inside its graph, unhooked) is left out and
    counted per block; never a structural difference."""
    sides = {"reference": ref.compiled(), "target": tgt.compiled()}
    if not any(sides.values()):
        return pairs, None
    blocks = {side: dict(info.get("blocks") or {}) for side, info in sides.items()}
    kept, hidden = [], {}
    for pair in pairs:
        lacking = "target" if pair[1] is None else "reference" if pair[0] is None else None
        entry = pair[0] or pair[1]
        block = None
        if lacking is not None and entry.phase in ("forward", "backward"):
            block = next((b for b in blocks[lacking] if _inside(entry.module, b)), None)
        if block is None:
            kept.append(pair)
            continue
        count = hidden.setdefault((lacking, block), {"side": lacking, "block": block, "entries": 0, "calls": set()})
        count["entries"] += 1
        count["calls"].add((entry.module, entry.call))
    gone = [{**h, "calls": len(h["calls"])} for h in hidden.values()]
    return kept, {**{side: info for side, info in sides.items() if info}, "hidden": gone}


def _inside(module: str, block: str) -> bool:
    """Whether the call of `module` (a file's module name, `(root)` the model) runs strictly inside `block`."""
    return module != ROOT_MODULE and module != block and (block == "" or module.startswith(block + "."))


def _updates_not_judged(ref: IterationFile, tgt: IterationFile, rows: list[Row]) -> Optional[str]:
    """When the target's optimizer did not start from the reference's state (`format/optimizer_state.py`), every
    parameter's update row is `not_judged`, with the reason; returns the reason (None: updates are judged)."""
    why = updates_not_judged(str(ref.meta.get(OPTIMIZER_STATE) or ""), str(tgt.meta.get(OPTIMIZER_STATE) or ""),
                             str(tgt.meta.get("optimizer") or ""))
    if why is None:
        return None
    trained = {(r.module, r.tensor) for r in rows if r.phase == "param_grad"}  # parameters (buffers have no grad)
    for row in rows:
        if row.phase == "optimizer" and (row.module, row.tensor) in trained and row.status in MEASURED:
            row.status, row.reason = NOT_JUDGED, "its optimizer did not start from the reference's state (see verdict)"
    return why


def _meta(f: IterationFile) -> dict[str, Any]:
    """The META_KEYS a file has; "" (how the file stores None) back to None."""
    return {k: (None if f.meta[k] == "" else f.meta[k]) for k in META_KEYS if k in f.meta}


def _loss(f: IterationFile) -> Optional[float]:
    if not f.has(LOSS):
        return None
    values = f.read(LOSS).reshape(-1)
    return float(values[0]) if values.size == 1 else None
