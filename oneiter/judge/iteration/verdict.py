"""The verdict of a comparison, decided once: the rule that decides what every report states about it.

Sits after the engine and blame (`engine.compare_files` builds a `CompareResult`: rows in causal order, the first
divergence, local results, the culprit's chain, the NaN/Inf origin, and every finding: `judge/iteration/findings.py`)
and before every writer. `decide` names the finding of highest priority (`findings.PRIORITY`, the one table of
priorities) and fills a `Verdict` (`statement.py`: what a verdict holds, its JSON form and its headline and details,
made of the sentences of `sentences.py`); the terminal report, JSON and CSV (`report/terminal.py`), the HTML page,
TensorBoard and the multi-rank summary (`report/rank_table.py`) only lay out what a `Verdict` holds (a saved JSON
report's through `Verdict.from_dict`). The rule that decides lives here, the words that say it in those two
modules, and nowhere else, so no two outputs can disagree; this module re-exports what the reports use of them.

**Status.** `match`, `diverged`, or `inconclusive` (the recording carries local data but not one call's own error
could be measured, or a call's calibration was not trusted and nothing else was found: neither is a pass; exit code
2, input that cannot be judged).

**Basis** (what the status rests on):
- `first_divergence`: no local data; the run diverges at the first entry outside tolerance in causal order;
- `local_error`: each call's own error against its expected noise; the **culprit** is the first call whose own
  error exceeds it (innermost, in causal order); entries missing on one side, of another shape or dtype, or whose
  NaN/Inf differ are divergences too; accumulated error outside tolerance alone is *drift*, not a divergence;
- `unattributed`: local data, no call to blame, but something no probe covers differs beyond what the precision
  explains (the loss, a parameter gradient, an unprobed call's output).

**Row statuses** follow the same rule as the flags beside them (`settled_rows`): a row whose own local error is
flagged is `diverged` even inside tolerance; with local data, a row outside tolerance whose own code is within
noise (and that nothing else explains badly) is `drift`, or `rounding` when everything it was computed from is
bitwise the reference's (then the difference is its own call's, never accumulated: `blame.own_values`); `match`
is inside tolerance and not flagged; missing, shape and dtype statuses stay as the engine set them.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any, Mapping, Optional, Protocol, Union

from oneiter.format.schema import ROOT_MODULE
from oneiter.formatting import json_ready, num
from oneiter.judge.iteration.entries import MEASURED, NOT_JUDGED, LocalResult, Row
from oneiter.judge.iteration.findings import UNATTRIBUTED, Finding, of_kind, status_of, strongest
from oneiter.judge.iteration.impact import Impact
from oneiter.judge.iteration.recipe_costs import summary as format_summary
from oneiter.judge.iteration.sentences import (
    ROUNDING_VALUE,
    STATS_REASON,
    calibration_reason,
    culprit_reason,
    entry_name,
    impact_lines,
    nonfinite_differs,
    rounding_reason,
)
from oneiter.judge.iteration.statement import EXIT_CODES, FOCUS, Culprit, RankedVerdict, Sentences, Verdict, render

# the verdict's own names, then what the reports and the engine read of the verdict through here: the types and words
# it is stated in (`statement.py`, `sentences.py`) and how numbers are written (`oneiter.formatting`)
__all__ = ["Evidence", "decide", "decide_ranked", "settled_rows", "settle_rows",
           "Verdict", "Culprit", "RankedVerdict", "Sentences", "render", "EXIT_CODES", "FOCUS",
           "culprit_reason", "calibration_reason", "entry_name", "impact_lines", "num", "json_ready"]

HINT_RTOLS = 10  # a divergence no larger than this many rtol is rounding-noise size: say so


class Evidence(Protocol):
    """What a verdict is decided from: a `results.CompareResult` as the engine leaves it (its rows settled, blame's
    findings recorded). Named here, not imported, because the result decides its verdict from this module."""

    reference: str
    rows: list[Row]
    first_divergence: Optional[int]
    findings: list[Finding]
    local_kind: str
    local: list[LocalResult]
    chain: list[dict]
    culprit_includes: list[dict]
    nan_origin: Optional[dict]
    unprobed: list[dict]
    notes: list[str]
    precision: Optional[dict]
    compiled: Optional[dict]
    rounding: set[int]
    impact: Optional[Impact]
    meta_reference: dict[str, Any]
    meta_target: dict[str, Any]
    microbatches: dict[tuple[str, int], int]

    def local_for(self, row: Row) -> Optional[LocalResult]: ...


class StepsVerdict(Protocol):
    """What `decide_ranked` reads of a rank's multi-step verdict (`judge/stepwise/step_verdict.StepVerdict`, a layer
    above this module: named here, not imported)."""

    status: str
    title: str
    step: Optional[int]


def settled_rows(result: Evidence, findings: list[Finding]) -> list[Row]:
    """The rows with the status each one's flag implies (see the module docstring), the `unexplained` `findings`
    theirs: a new `Row` for each row whose status changes. The engine settles them once, before it records the
    findings."""
    if not result.local_kind:
        return list(result.rows)
    unexplained = {f.entry: f.reason for f in of_kind(findings, "unexplained")}
    return [_settled(i, row, result, unexplained) for i, row in enumerate(result.rows)]


def _settled(i: int, row: Row, result: Evidence, unexplained: dict[Optional[int], str]) -> Row:
    if row.status not in MEASURED:
        return row
    local = result.local_for(row)
    if local is not None and local.flagged:
        reason = f"inside tolerance, but {culprit_reason(local)}" if row.status == "match" else row.reason
        return replace(row, status="diverged", reason=reason)
    if i in unexplained:  # what an unattributed verdict rests on (inside tolerance too, in another precision)
        return replace(row, status="diverged", reason=unexplained[i])
    if local is not None and local.rounding and i in result.rounding:  # inside tolerance or not: rounding
        return replace(row, status="rounding", reason=rounding_reason(local))
    if row.status == "diverged":
        assert row.metrics is not None  # a measured divergence holds its metrics (`engine._Judge._measure`)
        if not row.metrics.nonfinite_differs:
            # computed from values bitwise the reference's: its own rounding; otherwise accumulated drift
            return replace(row, status="rounding" if i in result.rounding else "drift")
    return row


def settle_rows(result: Evidence, findings: list[Finding]) -> None:
    """`settled_rows` into the result's own list of rows."""
    result.rows[:] = settled_rows(result, findings)


def decide(result: Evidence) -> Verdict:
    """The verdict of a settled comparison: the strongest of its findings (`findings.PRIORITY`) decides the status,
    the basis and the entry named; without local data the basis is the first divergence, and with local data but
    no local result and no finding nothing was judged (inconclusive)."""
    rows, first, findings = result.rows, result.first_divergence, result.findings
    top = strongest(findings)
    culprit = next((_culprit(f, result.microbatches) for f in of_kind(findings, "culprit")), None)
    if not result.local_kind:
        basis = "first_divergence"
    else:
        basis = "unattributed" if top is not None and top.kind in UNATTRIBUTED else "local_error"
    status = status_of(findings, judged=not (result.local_kind and not result.local))
    entry = None if top is None else _named(result, top)
    counts = {s: sum(r.status == s for r in rows) for s in ("match", "drift", "rounding", NOT_JUDGED)}
    worst = max(result.local, key=lambda r: r.ratio, default=None)
    verdict = Verdict(
        status=status, basis=basis, focus=None if top is None else FOCUS[top.kind], entry=entry, culprit=culprit,
        chain=tuple(result.chain), culprit_includes=tuple(result.culprit_includes),
        first_divergence=None if first is None else _entry(rows, first, result.microbatches),
        nan_origin=result.nan_origin, unprobed=tuple(result.unprobed),
        unexplained=tuple({**_entry(rows, f.entry, result.microbatches), "why": f.reason}
                          for f in of_kind(findings, "unexplained")),
        loss_unexplained=next((f.reason for f in of_kind(findings, "loss")), None),
        hint=_hint(result, basis, entry) or _compiled_next(result, culprit),
        num_entries=len(rows), num_matched=counts["match"], num_drift=counts["drift"],
        num_rounding=counts["rounding"], num_diverged=len(rows) - sum(counts.values()), local_kind=result.local_kind,
        num_rounding_values=sum(r.status == "rounding" and r.reason.startswith(ROUNDING_VALUE) for r in rows),
        num_local=len(result.local),
        num_local_calls=len({(r.module, r.call) for r in result.local if r.phase in ("forward", "backward")}),
        num_flagged=sum(r.flagged for r in result.local),
        worst_local=None if worst is None else {**worst.key._asdict(), "ratio": worst.ratio,
                                                "factor": worst.factor, "rel_l2": worst.error,
                                                "expected": worst.expected},
        largest_rel_l2=max((r.metrics.rel_l2 for r in rows if r.metrics and r.status != NOT_JUDGED), default=0.0),
        precision=result.precision, num_not_judged=counts[NOT_JUDGED], warnings=tuple(result.notes),
        compiled=result.compiled, untrusted=tuple(_untrusted(r) for r in result.local if r.untrusted),
        findings=tuple(f.as_dict() for f in findings), formats=format_summary(result.local), impact=result.impact,
    )
    title, reason, details = render(verdict)
    return replace(verdict, title=title, reason=reason, details=tuple(details))


def _untrusted(local: LocalResult) -> dict[str, Any]:
    """A local row whose calibration was not trusted, as the verdict lists it."""
    return {**local.key._asdict(), "rel_l2": local.rel_l2, "calibrated": local.calibrated, "bound": local.bound,
            "expected": local.expected, "calibration": local.calibration, "flagged": local.flagged}


def _named(result: Evidence, finding: Finding) -> dict[str, Any]:
    """The entry the verdict names for its strongest finding: a row (with the finding's reason when no probe
    explains it), the culprit's own error (or the call whose calibration was not trusted), or the loss."""
    if finding.kind in ("culprit", "calibration"):
        local = finding.local
        assert local is not None  # a culprit or calibration finding carries its local result
        status = "local_error" if finding.kind == "culprit" else "calibration_not_trusted"
        return {"index": finding.entry, **local.key._asdict(), "entry_status": status, "reason": finding.reason,
                "rel_l2": local.error, "max_abs": local.metrics.max_abs, "cosine": local.metrics.cosine,
                **_nonfinite_counts(local.metrics), **_microbatch(result.microbatches, local.module, local.call,
                                                                  local.phase)}
    if finding.kind == "loss":
        return {"index": None, "module": None, "call": None, "phase": "loss", "tensor": "loss",
                "entry_status": "diverged", "reason": finding.reason, "rel_l2": None, "max_abs": None, "cosine": None}
    if finding.kind == "collective":  # no row: the collective itself (`collectives.Judged`), and where it shows
        c = finding.collective
        assert c is not None  # a collective finding carries its judged collective
        return {"index": None, "module": None, "call": None, "phase": c["phase"], "tensor": None,
                "entry_status": "collective", "reason": finding.reason, "rel_l2": c["rel_l2"],
                "max_abs": c["max_abs"], "cosine": None, "collective": c, "order": c["order"]}
    entry = _entry(result.rows, finding.entry, result.microbatches)
    return {**entry, "reason": finding.reason} if finding.kind == "unexplained" else entry


def _culprit(finding: Finding, microbatches: dict) -> Culprit:
    local = finding.local
    assert local is not None  # a culprit finding carries its local result
    return Culprit(**local.key._asdict(), index=finding.entry, local_rel_l2=local.error, expected=local.expected,
                   ratio=local.ratio, calibrated=local.calibrated, nan_mismatch=local.metrics.num_mismatch,
                   reason=finding.reason,
                   microbatch=_microbatch(microbatches, local.module, local.call, local.phase).get("microbatch"),
                   recipe=local.recipe or None, format_cost=local.format_cost if local.recipe else None)


def _microbatch(microbatches: dict, module: str, call: int, phase: str) -> dict[str, int]:
    """{"microbatch": m} for a call's forward or backward entry in an iteration of several microbatches, else {}
    (a parameter's gradient and update are the whole iteration's)."""
    if not microbatches or phase not in ("forward", "backward") or (module, call) not in microbatches:
        return {}
    return {"microbatch": microbatches[(module, call)]}


def _nonfinite_counts(m) -> dict[str, int]:
    return {k: getattr(m, k) for k in ("num_nan_ref", "num_inf_ref", "num_nan_target", "num_inf_target")}


def _entry(rows: list[Row], index: Optional[int], microbatches: Optional[dict] = None) -> dict[str, Any]:
    """One row as the verdict names it: its index, key, status, reason and the numbers the sentences use (and its
    call's microbatch, in an iteration of several). `index` a finding's `entry`: one that names a row."""
    assert index is not None  # the findings named here (first divergence, structural, NaN/Inf, unexplained) name a row
    row, m = rows[index], rows[index].metrics
    data = {"index": index, **row.key._asdict(), "entry_status": row.status, "reason": row.reason,
            **_microbatch(microbatches or {}, row.module, row.call, row.phase)}
    if m is None:
        return {**data, "rel_l2": None, "max_abs": None, "cosine": None}
    tol = row.tolerance
    return {**data, "rel_l2": m.rel_l2, "max_abs": m.max_abs, "cosine": m.cosine, "max_rel": m.max_rel,
            "frac_out": m.frac_out, "atol": tol.atol if tol else None, "rtol": tol.rtol if tol else None,
            "need_atol": m.need_atol, "need_rtol": m.need_rtol, **_nonfinite_counts(m)}


def _hint(result: Evidence, basis: str, entry: Optional[dict]) -> Optional[str]:
    """A divergence no larger than rounding noise (10x rtol) may be no bug at all: say why it may happen."""
    if (basis == "local_error" or entry is None or entry.get("rtol") is None or nonfinite_differs(entry)
            or str(entry.get("reason") or "").startswith(STATS_REASON)):  # a statistics bound is no rounding size
        return None
    rel_l2, rtol = entry["rel_l2"], entry["rtol"]
    if not rel_l2 <= HINT_RTOLS * rtol:
        return None
    threads = result.meta_reference.get("num_threads"), result.meta_target.get("num_threads")
    cause = (f"the runs used {threads[0]} and {threads[1]} threads, which changes reduction order"
             if None not in threads and threads[0] != threads[1]
             else "a different reduction order (threads, kernels) changes results this much")
    return (f"hint: rel_l2 {rel_l2:.1e} is within {HINT_RTOLS}x rtol {rtol:.1e}, rounding-noise size: {cause}; "
            f"--rtol/--atol loosen the check")


def _compiled_next(result: Evidence, culprit: Optional[Culprit]) -> Optional[str]:
    """When the culprit is a block the target ran compiled (torch.compile: the calls inside it are not observable),
    the next commands: which node of its graph (`replay --layer --ops --compile`), or a recording that compiles
    smaller blocks (`--compile-modules`) so a call inside it can be named."""
    blocks = ((result.compiled or {}).get("target") or {}).get("blocks") or {}
    path = "" if culprit is None or culprit.module == ROOT_MODULE else culprit.module
    if culprit is None or path not in blocks:
        return None
    backend = str(blocks[path].get("backend") or "inductor")
    model = result.meta_target.get("model")
    spec = f" -m {model}" if model else ""
    children = f"'^{re.escape(path)}\\.[^.]+$'" if path else "'^[^.]+$'"
    layer = (f"`oneiter replay {result.reference} --layer {path} --call {culprit.call} --ops{spec} --compile "
             f"{backend}` judges each node of its graph (forward); " if path else "")
    return (f"next: {culprit.module} ran compiled ({backend}), so the calls inside it are not observable: {layer}"
            f"`oneiter record ... --compile {backend} --compile-modules {children}` compiles each of its children as "
            f"a block of its own, so the next compare names the call inside it")


def decide_ranked(verdicts: Mapping[int, Union[Verdict, StepsVerdict]]) -> RankedVerdict:
    """Combine one Verdict per rank (ascending ranks); of multi-step recordings (`StepVerdict`s, which name a
    `step`), the rank whose first step outside the band comes first."""
    diverged = tuple(r for r, v in verdicts.items() if v.status == "diverged")
    inconclusive = [r for r, v in verdicts.items() if v.status == "inconclusive"]
    total = len(verdicts)

    def position(rank: int) -> tuple:
        v = verdicts[rank]
        if not isinstance(v, Verdict):  # multi-step recordings: the first step outside the band
            step = v.step
            return (math.inf if step is None else step, rank)
        index = v.index
        if index is None:  # a collective: where its result first shows; else after every row
            index = (v.entry or {}).get("order")
        return (v.num_entries if index is None else index, rank)

    origin = min(diverged, key=position, default=None)
    if origin is not None:
        v = verdicts[origin]
        if not isinstance(v, Verdict):
            which = f": {', '.join(map(str, diverged))}" if len(diverged) > 1 else ""
            return RankedVerdict(status="diverged", rank=origin, num_ranks=total, diverged_ranks=diverged,
                                 headline=f"DIVERGED on rank {origin} at step {v.step} ({len(diverged)} of {total} "
                                          f"ranks diverged{which})", note=None)
        where = f" at {entry_name(v.entry)}" if v.entry and v.entry.get("module") is not None else f": {v.headline}"
        if v.focus == "collective":
            assert v.entry is not None  # a collective's verdict names it in its entry (`_named`)
            c = v.entry["collective"]
            where = f" at {c.get('kind', 'collective')} {c['name']}"
        which = f": {', '.join(map(str, diverged))}" if len(diverged) > 1 else ""
        headline = f"DIVERGED on rank {origin}{where} ({len(diverged)} of {total} ranks diverged{which})"
        return RankedVerdict(status="diverged", rank=origin, num_ranks=total, diverged_ranks=diverged,
                             headline=headline, note=_spread_note(verdicts, origin, diverged))
    if inconclusive:
        why = verdicts[inconclusive[0]].title.removeprefix("INCONCLUSIVE: ")  # the first such rank's reason
        return RankedVerdict(status="inconclusive", rank=None, num_ranks=total, diverged_ranks=(),
                             headline=f"INCONCLUSIVE on rank {', '.join(map(str, inconclusive))} of {total}: {why}",
                             note=None)
    return RankedVerdict(status="match", rank=None, num_ranks=total, diverged_ranks=(),
                         headline=f"MATCH on all {total} ranks", note=None)


def _spread_note(verdicts: Mapping[int, Union[Verdict, StepsVerdict]], origin: int,
                 diverged: tuple[int, ...]) -> Optional[str]:
    later = [r for r in diverged if r != origin and _entry_phase(verdicts[r]) in ("param_grad", "optimizer")]
    if not later:
        return None
    who = f"rank {later[0]} diverges" if len(later) == 1 else f"ranks {', '.join(map(str, later))} diverge"
    return (f"note: {who} only from param_grad on: gradients are averaged across ranks (DDP's allreduce, FSDP2's "
            f"reduce-scatter), so rank {origin}'s error reaches every rank's gradients and weights")


def _entry_phase(v: Union[Verdict, StepsVerdict]) -> Optional[str]:
    """The phase of the entry a rank's verdict names (None: it names none, or it is a multi-step verdict)."""
    return (v.entry or {}).get("phase") if isinstance(v, Verdict) else None
