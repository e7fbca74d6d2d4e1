"""The verdict of a comparison, decided once: what every report states about it, and the sentences it states it in.

Sits after the engine and blame (`engine.compare_files` fills a `CompareResult`: rows in causal order, the first
divergence, local results, the culprit's chain, the NaN/Inf origin, and every finding: `judge/iteration/findings.py`)
and before every writer. `decide` names the finding of highest priority (`findings.PRIORITY`, the one table of
priorities); the terminal report, JSON and CSV (`report/terminal.py`), the HTML page, TensorBoard and the
multi-rank summary (`report/ranks.py`) only lay out what a `Verdict` holds (a saved JSON report's through
`Verdict.from_dict`); the rule that decides and the words that say it live here and nowhere else, so no two
outputs can disagree.

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

**Row statuses** follow the same rule as the flags beside them (`settle_rows`): a row whose own local error is
flagged is `diverged` even inside tolerance; with local data, a row outside tolerance whose own code is within
noise (and that nothing else explains badly) is `drift`, or `rounding` when everything it was computed from is
bitwise the reference's (then the difference is its own call's, never accumulated: `blame.own_values`); `match`
is inside tolerance and not flagged; missing, shape and dtype statuses stay as the engine set them.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple, Optional, Protocol

from oneiter.format.schema import CLIP_ROW, ROOT_MODULE
from oneiter.formatting import json_ready, num, sci
from oneiter.judge.iteration.entries import MEASURED, NOT_JUDGED, LocalResult, Row
from oneiter.judge.iteration.findings import UNATTRIBUTED, Finding, of_kind, status_of, strongest
from oneiter.judge.iteration.formats import lines as format_lines
from oneiter.judge.iteration.formats import recipe_error
from oneiter.judge.iteration.formats import summary as format_summary
from oneiter.judge.iteration.impact import Impact
from oneiter.runtime.compiled import random_lines
from oneiter.runtime.precision_modes import describe, reduced

__all__ = ["Verdict", "Culprit", "Evidence", "RankedVerdict", "Sentences", "decide", "decide_ranked", "settle_rows",
           "render", "culprit_reason", "calibration_reason", "EXIT_CODES", "FOCUS", "num", "json_ready", "entry_name",
           "impact_lines"]

# inconclusive: recordings that cannot be judged are bad input for judging (2), never a pass; 3 is an internal error
EXIT_CODES = {"match": 0, "diverged": 1, "inconclusive": 2}
HINT_RTOLS = 10  # a divergence no larger than this many rtol is rounding-noise size: say so
SENSITIVITY_SAID = 0.05  # a rounding moving the impact ranking's gap by more than this share of it: said
# what the verdict calls the entry it names, by the kind of the finding it rests on (`findings.PRIORITY`)
FOCUS = {"first_divergence": "first divergence", "structural": "structural difference", "collective": "collective",
         "culprit": "culprit", "nan_inf": "NaN/Inf difference", "unexplained": "unexplained entry", "loss": "loss",
         "calibration": "calibration not trusted"}


def entry_name(item: dict) -> str:
    """`layer1.0.conv1@0 forward output`: how every report names an entry (or a culprit, or the NaN/Inf origin); in an
    iteration of several microbatches, with its call's: `layers.0.mlp@1 forward output (microbatch 1)`."""
    name = f"{item.get('module')}@{item.get('call')} {item.get('phase')} {item.get('tensor')}"
    micro = item.get("microbatch")
    return name if micro is None else f"{name} (microbatch {micro})"


# -- the decision ---------------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class Culprit:
    """The first call whose own code's error exceeds its expected noise, and its row in the report."""

    module: str
    call: int
    phase: str
    tensor: str
    """The call's own tensor (`output`, `grad_input.0`) or one it handed a child (`layer1.0.conv2@0:input.0`)."""
    index: Optional[int]
    """Its accumulated row (`#` of the tables); None when the report has no row for that tensor."""
    local_rel_l2: float
    expected: float
    ratio: float
    calibrated: Optional[float]
    nan_mismatch: int
    reason: str
    microbatch: Optional[int] = None
    """The microbatch whose call it is, in an iteration of several (gradient accumulation); None: one."""
    recipe: Optional[str] = None
    """The low-precision recipe the call runs: `local_rel_l2` is then its deviation from the recipe's exact
    emulation, `expected` the accumulation's noise, `format_cost` what the format itself costs (None: no recipe)."""
    format_cost: Optional[float] = None

    @property
    def name(self) -> str:
        """`layer3.1.conv2@0 forward output`, as the reports name it."""
        return entry_name(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Culprit:
        """The culprit of a saved report's verdict (numbers as `num` reads them; what it lacks, None)."""
        values = {f.name: d.get(f.name) for f in fields(cls)}
        numbers = ("local_rel_l2", "expected", "ratio", "calibrated", "format_cost")
        return cls(**{**values, **{k: num(values[k]) for k in numbers}})


@dataclass(frozen=True)
class Verdict:
    """What a comparison decided, computed once (`decide`); `as_dict()` is the JSON report's `verdict`."""

    status: str
    """`match`, `diverged` or `inconclusive`."""
    basis: str
    """`local_error`, `unattributed` or `first_divergence` (see the module docstring)."""
    focus: Optional[str]
    """What the verdict names: `culprit`, `first divergence`, `structural difference`, `unexplained entry` or
    `loss`; None on a match."""
    entry: Optional[dict]
    """The entry it names: index (its row), module, call, phase, tensor, entry_status, reason and metrics."""
    culprit: Optional[Culprit]
    chain: tuple[dict, ...]
    """The culprit's call and every call containing it, innermost first: module, call, flagged, max_ratio."""
    culprit_includes: tuple[dict, ...]
    first_divergence: Optional[dict]
    """The first entry outside tolerance in causal order (an entry like `entry`); drift when local data decides."""
    nan_origin: Optional[dict]
    unprobed: tuple[dict, ...]
    unexplained: tuple[dict, ...]
    loss_unexplained: Optional[str]
    hint: Optional[str]
    num_entries: int
    num_matched: int
    num_drift: int
    num_diverged: int
    local_kind: str
    num_local: int
    num_local_calls: int
    num_flagged: int
    worst_local: Optional[dict]
    largest_rel_l2: float
    precision: Optional[dict] = None
    """The reduced-precision float32 modes (TF32...) each side ran and the calibration reproduced
    (`engine._precision`); None when neither side ran any."""
    num_rounding: int = 0
    """Rows outside tolerance that are their own call's rounding (computed from values bitwise the reference's), and
    rows that are rounding themselves (`num_rounding_values` of them)."""
    num_rounding_values: int = 0
    """Rows whose value is rounding itself (its precision's own error for it is as large as it: `rounding_reason`)."""
    num_not_judged: int = 0
    """Rows measured but not judged (`not_judged`: updates from another optimizer state)."""
    compiled: Optional[dict] = None
    """What each side compiled (torch.compile blocks, graphs, graph breaks, compile seconds) and the entries left
    out because they run inside the other side's compiled blocks (`engine._hidden`); None: neither compiled."""
    warnings: tuple[str, ...] = ()
    """What changes the verdict's meaning (the result's notes: not a replay, updates not judged, a tolerance file
    for another device, calibration kernels that were not torch's own); every report states them among the
    details."""
    untrusted: tuple[dict, ...] = ()
    formats: Optional[dict] = None
    """The low-precision recipes the target's calls run (`formats.summary`): per recipe its calls, the format's cost
    and how closely the target follows it; None when no call runs one."""
    """Every local row whose calibrated noise was not trusted (far above what its precision can produce): module,
    call, phase, tensor, rel_l2, calibrated, bound, expected, calibration, flagged."""
    findings: tuple[dict, ...] = ()
    """Every finding it chose among (`Finding.as_dict`: kind, priority, entry, reason), in the order recorded: the
    JSON report's `verdict.findings`, in the same shape as a multi-step comparison's."""
    impact: Optional[Impact] = None
    """The flagged calls ranked by the share of the gap fixing each closes (`record --impact`,
    `judge/iteration/impact.py`); None when the target was recorded without it. The details say which fix matters
    most."""
    title: str = ""
    reason: str = ""
    details: tuple[str, ...] = ()

    @property
    def index(self) -> Optional[int]:
        """The row the verdict names (the culprit's or the divergent entry's); None when it names none."""
        return self.where["index"]

    @property
    def headline(self) -> str:
        """The one line every report leads with."""
        return f"{self.title}: {self.reason}" if self.reason else self.title

    @property
    def lines(self) -> list[str]:
        """Headline, then the details (hint, NaN/Inf origin, culprit, basis, chain, unprobed, first divergence)."""
        return [self.headline, *self.details]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def roles(self, index: int) -> list[str]:
        """What row `index` is to the verdict: `verdict` (the entry it names), `culprit`, `first_divergence`."""
        first = self.first_divergence["index"] if self.first_divergence else None
        culprit = self.culprit.index if self.culprit else None
        return [name for name, at in (("verdict", self.index), ("culprit", culprit), ("first_divergence", first))
                if at == index]

    @property
    def where(self) -> dict:
        """The entry it names, or one whose every field is None (what the JSON report flattens into `verdict`)."""
        return dict(self.entry) if self.entry else {"index": None, **dict.fromkeys(_WHERE)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "basis": self.basis, "focus": self.focus, **self.where,
            "headline": self.headline, "details": list(self.details), "hint": self.hint,
            "culprit": self.culprit.as_dict() if self.culprit else None, "chain": list(self.chain),
            "culprit_includes": list(self.culprit_includes), "nan_origin": self.nan_origin,
            "unprobed": list(self.unprobed), "unexplained": list(self.unexplained),
            "loss_unexplained": self.loss_unexplained, "first_divergence": self.first_divergence,
            "num_entries": self.num_entries, "num_matched": self.num_matched, "num_drift": self.num_drift,
            "num_rounding": self.num_rounding, "num_rounding_values": self.num_rounding_values,
            "num_diverged": self.num_diverged, "local_kind": self.local_kind,
            "num_local": self.num_local,
            "num_local_calls": self.num_local_calls, "num_flagged": self.num_flagged,
            "worst_local": self.worst_local, "largest_rel_l2": self.largest_rel_l2, "precision": self.precision,
            "num_not_judged": self.num_not_judged, "warnings": list(self.warnings), "compiled": self.compiled,
            "untrusted": list(self.untrusted), "findings": list(self.findings), "formats": self.formats,
            "impact": self.impact.as_dict() if self.impact is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        """The Verdict of a saved JSON report's `verdict` (or `as_dict()`): its own keys, the entry it names from
        the rest, and the sentences rendered again from them (as the report was; `headline` is not trusted)."""
        where = {k: v for k, v in d.items() if k not in _OWN}
        unnamed = d.get("focus") is None and all(v is None for v in where.values())
        own = {name: d.get(name) for name in _OWN_FIELDS}
        verdict = cls(**{
            **own, "entry": None if unnamed else where,
            "culprit": Culprit.from_dict(d["culprit"]) if d.get("culprit") else None,
            **{name: tuple(d.get(name) or ()) for name in ("chain", "culprit_includes", "unprobed", "unexplained",
                                                           "warnings", "untrusted", "findings")},
            "largest_rel_l2": num(d.get("largest_rel_l2")), "num_not_judged": int(d.get("num_not_judged") or 0),
            "num_rounding_values": int(d.get("num_rounding_values") or 0),
            "impact": Impact.from_dict(d.get("impact")),
        })
        title, reason, details = render(verdict)
        return replace(verdict, title=title, reason=reason, details=tuple(details))


_WHERE = ("module", "call", "phase", "tensor", "entry_status", "reason", "rel_l2", "max_abs", "cosine")
# the keys of `Verdict.as_dict()` that are the verdict's own; every other one belongs to the entry it names
_OWN = ("status", "basis", "focus", "headline", "details", "hint", "culprit", "chain", "culprit_includes",
        "nan_origin", "unprobed", "unexplained", "loss_unexplained", "first_divergence", "num_entries", "num_matched",
        "num_drift", "num_rounding", "num_rounding_values", "num_diverged", "local_kind", "num_local",
        "num_local_calls", "num_flagged", "worst_local", "largest_rel_l2", "precision", "num_not_judged", "warnings",
        "untrusted", "findings", "compiled", "formats", "impact")
_OWN_FIELDS = ("status", "basis", "focus", "first_divergence", "nan_origin", "loss_unexplained", "hint", "num_entries",
               "num_matched", "num_drift", "num_rounding", "num_diverged", "local_kind", "num_local", "num_local_calls",
               "num_flagged", "worst_local", "precision", "compiled", "formats")


def settle_rows(result: Evidence, findings: list[Finding]) -> None:
    """Give every measured row the status its flag implies (see the module docstring), the `unexplained`
    `findings` theirs; the engine calls it once, before it records the findings."""
    if not result.local_kind:
        return
    unexplained = {f.entry: f.reason for f in of_kind(findings, "unexplained")}
    for i, row in enumerate(result.rows):
        if row.status not in MEASURED:
            continue
        local = result.local_for(row)
        if local is not None and local.flagged:
            if row.status == "match":
                row.reason = f"inside tolerance, but {culprit_reason(local)}"
            row.status = "diverged"
        elif i in unexplained:  # what an unattributed verdict rests on (inside tolerance too, in another precision)
            row.status, row.reason = "diverged", unexplained[i]
        elif local is not None and local.rounding and i in result.rounding:  # inside tolerance or not: rounding
            row.status, row.reason = "rounding", rounding_reason(local)
        elif row.status == "diverged" and not row.metrics.nonfinite_differs:
            # computed from values bitwise the reference's: its own rounding; otherwise accumulated drift
            row.status = "rounding" if i in result.rounding else "drift"


ROUNDING_VALUE = "its value is rounding"  # how the reason of a row that is rounding itself starts (`rounding_reason`)


def rounding_reason(local: LocalResult) -> str:
    """Why a row whose value its precision cannot resolve is rounding (`LocalResult.rounding`), with its figures."""
    return (f"{ROUNDING_VALUE}: its precision's own error for it, {sci(local.expected)} relative to float64, is as "
            f"large as the value (0, or far below what it was computed from, in exact arithmetic: a bias's gradient "
            f"before a BatchNorm); its own error {sci(local.rel_l2)} is within that")


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
        worst_local=None if worst is None else {**dict(zip(_KEY, worst.key, strict=True)), "ratio": worst.ratio,
                                                "factor": worst.factor, "rel_l2": worst.error,
                                                "expected": worst.expected},
        largest_rel_l2=max((r.metrics.rel_l2 for r in rows if r.metrics and r.status != NOT_JUDGED), default=0.0),
        precision=result.precision, num_not_judged=counts[NOT_JUDGED], warnings=tuple(result.notes),
        compiled=result.compiled, untrusted=tuple(_untrusted(r) for r in result.local if r.untrusted),
        findings=tuple(f.as_dict() for f in findings), formats=format_summary(result.local), impact=result.impact,
    )
    title, reason, details = render(verdict)
    return replace(verdict, title=title, reason=reason, details=tuple(details))


_KEY = ("module", "call", "phase", "tensor")


def _untrusted(local: LocalResult) -> dict[str, Any]:
    """A local row whose calibration was not trusted, as the verdict lists it."""
    return {"module": local.module, "call": local.call, "phase": local.phase, "tensor": local.tensor,
            "rel_l2": local.rel_l2, "calibrated": local.calibrated, "bound": local.bound, "expected": local.expected,
            "calibration": local.calibration, "flagged": local.flagged}


def _named(result: Evidence, finding: Finding) -> dict[str, Any]:
    """The entry the verdict names for its strongest finding: a row (with the finding's reason when no probe
    explains it), the culprit's own error (or the call whose calibration was not trusted), or the loss."""
    if finding.kind in ("culprit", "calibration"):
        local = finding.local
        return {"index": finding.entry, "module": local.module, "call": local.call, "phase": local.phase,
                "tensor": local.tensor, "entry_status": "local_error" if finding.kind == "culprit" else
                "calibration_not_trusted", "reason": finding.reason,
                "rel_l2": local.error, "max_abs": local.metrics.max_abs, "cosine": local.metrics.cosine,
                **_nonfinite_counts(local.metrics), **_microbatch(result.microbatches, local.module, local.call,
                                                                  local.phase)}
    if finding.kind == "loss":
        return {"index": None, "module": None, "call": None, "phase": "loss", "tensor": "loss",
                "entry_status": "diverged", "reason": finding.reason, "rel_l2": None, "max_abs": None, "cosine": None}
    if finding.kind == "collective":  # no row: the collective itself (`collectives.Judged`), and where it shows
        c = finding.collective
        return {"index": None, "module": None, "call": None, "phase": c["phase"], "tensor": None,
                "entry_status": "collective", "reason": finding.reason, "rel_l2": c["rel_l2"],
                "max_abs": c["max_abs"], "cosine": None, "collective": c, "order": c["order"]}
    entry = _entry(result.rows, finding.entry, result.microbatches)
    return {**entry, "reason": finding.reason} if finding.kind == "unexplained" else entry


def _culprit(finding: Finding, microbatches: dict) -> Culprit:
    local = finding.local
    return Culprit(local.module, local.call, local.phase, local.tensor, finding.entry, local.error, local.expected,
                   local.ratio, local.calibrated, local.metrics.num_mismatch, finding.reason,
                   _microbatch(microbatches, local.module, local.call, local.phase).get("microbatch"),
                   local.recipe or None, local.format_cost if local.recipe else None)


def _microbatch(microbatches: dict, module: str, call: int, phase: str) -> dict[str, int]:
    """{"microbatch": m} for a call's forward or backward entry in an iteration of several microbatches, else {}
    (a parameter's gradient and update are the whole iteration's)."""
    if not microbatches or phase not in ("forward", "backward") or (module, call) not in microbatches:
        return {}
    return {"microbatch": microbatches[(module, call)]}


def culprit_reason(local: LocalResult) -> str:
    """Why a call's own result is blamed, in the verdict's words (its row's reason when flagged inside tolerance)."""
    if local.recipe and not local.metrics.num_mismatch:
        return recipe_error(local.recipe, local.error, local.ratio, local.expected, local.format_cost)
    return _own_error(local.tensor, local.rel_l2, local.ratio, local.expected, local.metrics.num_mismatch,
                      local.calibrated)


def calibration_reason(local: LocalResult) -> str:
    """Why a call's calibration is not trusted, with both figures (the `calibration` finding's reason)."""
    return (f"{_noise_claim(local.calibration, local.calibrated, local.expected)}; its own error rel_l2 "
            f"{sci(local.rel_l2)} is within {local.factor:g}x that, so the call is neither cleared nor blamed")


def _noise_claim(calibration: Any, calibrated: Any, expected: Any) -> str:
    """`its calibrated noise N is Rx what the precision can produce for it (B, on the trusted path): not used`."""
    ratio = (num(calibrated) or 0.0) / (num(expected) or math.inf)
    if str(calibration or "").startswith("device"):
        return (f"the device's own noise {sci(calibrated)} for it is {ratio:.0f}x the trusted CPU's "
                f"({sci(expected)}, the precision's modes as recorded): a finding about the device's kernels, not "
                f"used as noise")
    return (f"its calibrated noise {sci(calibrated)} is {ratio:.0f}x what its precision can produce for it "
            f"({sci(expected)}, measured on the trusted path): calibration not trusted, not used as noise")


def _nonfinite_counts(m) -> dict[str, int]:
    return {k: getattr(m, k) for k in ("num_nan_ref", "num_inf_ref", "num_nan_target", "num_inf_target")}


def _entry(rows: list[Row], index: int, microbatches: Optional[dict] = None) -> dict[str, Any]:
    """One row as the verdict names it: its index, key, status, reason and the numbers the sentences use (and its
    call's microbatch, in an iteration of several)."""
    row, m = rows[index], rows[index].metrics
    data = {"index": index, "module": row.module, "call": row.call, "phase": row.phase, "tensor": row.tensor,
            "entry_status": row.status, "reason": row.reason,
            **_microbatch(microbatches or {}, row.module, row.call, row.phase)}
    if m is None:
        return {**data, "rel_l2": None, "max_abs": None, "cosine": None}
    tol = row.tolerance
    return {**data, "rel_l2": m.rel_l2, "max_abs": m.max_abs, "cosine": m.cosine, "max_rel": m.max_rel,
            "frac_out": m.frac_out, "atol": tol.atol if tol else None, "rtol": tol.rtol if tol else None,
            "need_atol": m.need_atol, "need_rtol": m.need_rtol, **_nonfinite_counts(m)}


STATS_REASON = "from statistics"  # how the engine starts the reason of an entry judged from `--level stats` data


def _hint(result: Evidence, basis: str, entry: Optional[dict]) -> Optional[str]:
    """A divergence no larger than rounding noise (10x rtol) may be no bug at all: say why it may happen."""
    if (basis == "local_error" or entry is None or entry.get("rtol") is None or _nonfinite_differs(entry)
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


# -- the sentences --------------------------------------------------------------------------------------------------
class Sentences(NamedTuple):
    """A verdict in words: `title` (`DIVERGED at ...`), `reason` (the numbers; may be ""), `details` (lines)."""

    title: str
    reason: str
    details: list[str]


def render(v: Verdict) -> Sentences:
    """The words for a verdict (decided, or rebuilt from a saved JSON report by `Verdict.from_dict`): the terminal,
    HTML and TensorBoard all print these, so they say the same."""
    title, reason = _headline(v)
    return Sentences(title, reason, _details(v))


def _headline(v: Verdict) -> tuple[str, str]:
    where, n = v.where, v.num_entries
    if v.status == "match" and v.basis == "local_error":
        return _local_match(v)
    if v.status == "match":
        judged, unjudged = (f"{n - v.num_not_judged} judged", f"; {v.num_not_judged} updates not judged (why: "
                            f"below)") if v.num_not_judged else (str(n), "")
        largest = num(v.largest_rel_l2) or 0
        return f"MATCH: all {judged} entries within tolerance (largest rel_l2 {largest:.2e}){unjudged}", ""
    if v.status == "inconclusive" and v.focus == FOCUS["calibration"]:
        return f"INCONCLUSIVE: the calibration of {entry_name(where)} is not trusted", str(where.get("reason") or "")
    if v.status == "inconclusive":
        return ("INCONCLUSIVE: no call's own error could be measured",
                f"the recording has local data but no local result; {len(v.unprobed)} calls could not "
                f"be probed and the {n} entries were only checked for error growth: not a pass")
    if where.get("entry_status") == "local_error" and v.culprit:
        return f"DIVERGED: culprit {v.culprit.name}{_at(v.culprit)}", _blamed(v.culprit)
    if v.focus == "collective":
        c = where["collective"]
        return f"DIVERGED at {c.get('kind', 'collective')} {c['name']}", str(where.get("reason") or "")
    if v.basis == "unattributed":
        if where.get("module") is None:
            return "DIVERGED (unattributed)", f"no call's own code is to blame, but {where.get('reason')}"
        return (f"DIVERGED (unattributed) at {entry_name(where)}",
                f"no call's own code is to blame, but this entry's {where.get('reason')}")
    if v.focus == "loss":
        return "DIVERGED at the loss", str(where.get("reason") or "")
    return f"DIVERGED at {entry_name(where)}", _numbers(where)


def _at(c: Culprit) -> str:
    return "" if c.index is None else f" (#{c.index})"


def _local_match(v: Verdict) -> tuple[str, str]:
    worst = v.worst_local or {}
    title = f"MATCH: no call's own error exceeds its expected noise x{num(worst.get('factor')) or 4:g}"
    parts = [f"{v.num_local} tensors judged, highest ratio {num(worst.get('ratio')) or 0:.1f}x at "
             f"{entry_name(worst)}"]
    if v.num_drift:
        parts.append(f"{v.num_drift} of {v.num_entries} entries are outside tolerance: accumulated "
                     f"drift, which this verdict does not rest on")
    if v.num_rounding_values:
        parts.append(f"{v.num_rounding_values} are rounding themselves: their precision's own error for them is as "
                     f"large as their value (0 in exact arithmetic), within their noise")
    if v.num_rounding - v.num_rounding_values:
        parts.append(f"{v.num_rounding - v.num_rounding_values} are outside tolerance from values bitwise the "
                     f"reference's: their own call's rounding, within its noise")
    if v.unprobed:
        parts.append(f"{len(v.unprobed)} calls not probed, judged by error growth only")
    if v.num_not_judged:
        parts.append(f"{v.num_not_judged} updates not judged (why: below)")
    return title, "; ".join(parts)


def _blamed(c: Culprit) -> str:
    if c.recipe and not c.nan_mismatch:
        return recipe_error(c.recipe, c.local_rel_l2, c.ratio, c.expected, c.format_cost)
    return _own_error(c.tensor, c.local_rel_l2, c.ratio, c.expected, c.nan_mismatch, c.calibrated)


def _own_error(tensor: Any, rel_l2: Optional[float], ratio: Optional[float], expected: Optional[float],
               nan_mismatch: Optional[int], calibrated: Any = None) -> str:
    """Why a call's own result is blamed: its error against its expected noise, or NaN/Inf it made; and when its
    calibrated noise was not trusted (above the expected one, which is then the bound's), both figures."""
    if nan_mismatch:
        return (f"{nan_mismatch} NaN/Inf at other positions (or with another sign) than in the reference, "
                f"given the same inputs")
    tensor = str(tensor)
    if tensor == CLIP_ROW:  # judged on the target's own gradients (`record/local/clipping.py`)
        return (f"the coefficient the gradient clipping applied is rel {sci(rel_l2)} off min(1, max_norm / total "
                f"norm) of the float64 norm of the gradients backward left (max_norm: the reference's clipping's), "
                f"{num(ratio) or 0:.1f}x the rounding of those norms {sci(expected)}")
    own = f"its own code's (what it hands {tensor.partition(':')[0]})" if ":" in tensor else "its own code's"
    text = (f"{own} error rel_l2 {sci(rel_l2)}, on the reference's inputs, is "
            f"{num(ratio) or 0:.1f}x its expected noise {sci(expected)}")
    if num(calibrated) is not None and num(expected) is not None and num(calibrated) > num(expected):
        text += (f" (what its precision can produce for it; its calibrated noise {sci(calibrated)} is not "
                 f"trusted, far above that)")
    return text


def _nonfinite_differs(e: dict) -> bool:
    ref = (e.get("num_nan_ref"), e.get("num_inf_ref"))
    return ref != (e.get("num_nan_target"), e.get("num_inf_target"))


def _nan_inf(e: dict) -> str:
    return f"NaN {e['num_nan_ref']} vs {e['num_nan_target']}, Inf {e['num_inf_ref']} vs {e['num_inf_target']}"


def _numbers(e: dict) -> str:
    """An entry's difference: NaN/Inf counts first when they differ, then the metrics of the finite elements."""
    if num(e.get("rel_l2")) is None:
        return f"{str(e.get('entry_status', '')).replace('_', ' ')} ({e.get('reason', '')})"
    if str(e.get("reason") or "").startswith(STATS_REASON):  # `--level stats`: no elementwise numbers exist
        return str(e["reason"])
    numbers = (f"max_abs {sci(e.get('max_abs'))} max_rel {sci(e.get('max_rel'))} rel_l2 {sci(e.get('rel_l2'))} "
               f"cosine {num(e.get('cosine')):.6f}")
    if num(e.get("frac_out")) is not None and num(e.get("atol")) is not None:
        numbers += (f", {num(e['frac_out']):.2%} of elements outside atol {num(e['atol']):.1e} "
                    f"rtol {num(e['rtol']):.1e}")
    if _nonfinite_differs(e) and e.get("num_nan_ref") is not None:
        return f"{_nan_inf(e)} (reference vs target); finite elements: {numbers}"
    if num(e.get("need_atol")) is not None:
        numbers += f" (would pass with atol {num(e['need_atol']):.1e} or rtol {num(e['need_rtol']):.1e})"
    return numbers


def _details(v: Verdict) -> list[str]:
    lines = [*_first_fix(v.impact), *([v.hint] if v.hint else [])]
    lines += [f"warning: {w}" for w in v.warnings]  # they change what the headline means: early
    if v.nan_origin:
        lines.append(f"NaN/Inf origin: {entry_name(v.nan_origin)} (its inputs are finite)")
    if v.culprit and v.where.get("entry_status") != "local_error":
        lines.append(f"Culprit: {v.culprit.name}{_at(v.culprit)}: {_blamed(v.culprit)}")
    if v.focus == "collective":
        c = v.where["collective"]
        if c.get("kind") == "transfer":
            lines.append(f"transfers: {c.get('num_flagged', 1)} of this rank's collectives and transfers are off the "
                         f"exact result of their recorded inputs or what the sending rank sent (the first is named); "
                         f"each call that consumed one is judged on the reference's value")
        else:
            lines.append(f"collectives: {c.get('num_flagged', 1)} of this rank's collectives are off the exact result "
                         f"of their group's recorded inputs (the first is named); each call that consumed one is "
                         f"judged on the reference's result")
    lines.append(_basis_line(v))
    lines += _compiled_lines(v.compiled)
    if v.basis != "first_divergence":
        lines += _precision_lines(v.precision)
        lines += _local_lines(v)
        lines += _untrusted_lines(v.untrusted)
        lines += format_lines(v.formats)
    lines += _impact_lines(v.impact)
    if v.first_divergence and v.basis != "first_divergence":  # that basis line names it already
        lines.append(_first_divergence_line(v.first_divergence))
    return lines


def _pct(value: float) -> str:
    return "n/a" if num(value) is None or math.isnan(value) else f"{100 * value:.0f} %"


def _first_fix(impact: Optional[Impact]) -> list[str]:
    """The line naming the fix that matters most (`record --impact`): the first of the ranking, what it closes; none
    where a rounding moves the gaps as far as a fix (`Impact.evidence`: `_impact_lines` says so)."""
    if impact is None or impact.note or not impact.fixes or not impact.fixes[0].measured or not impact.evidence:
        return []
    fix, n = impact.fixes[0], len(impact.fixes)
    of = f", the most of the {n} flagged calls fixed one at a time" if n > 1 else ""
    close = [f for f in impact.fixes[1:] if f.measured and _apart(fix, f, impact) <= impact.sensitivity]
    if close:  # within what one rounding moves: their order is not told apart
        of += f" ({', '.join(f.name for f in close)} within one rounding's reach of it: not told apart)"
    if impact.step is not None:  # over several steps: the loss gap of the last step, each call fixed at every step
        return [f"fix first: {fix.name} ({fix.phase} {fix.tensor}), fixed at every step: it closes "
                f"{_pct(fix.share)} of the loss gap at step {impact.step}{of}"]
    if impact.by_loss:
        return [f"fix first: {fix.name} ({fix.phase} {fix.tensor}): fixing it closes {_pct(fix.share)} of the loss "
                f"gap (gradients {_pct(fix.grad_share)}, updated weights {_pct(fix.weight_share)}){of}"]
    return [f"fix first: {fix.name} ({fix.phase} {fix.tensor}): the loss is the reference's bit for bit; fixing it "
            f"closes {_pct(fix.grad_share)} of the gradients' gap (updated weights {_pct(fix.weight_share)}){of}"]


def impact_lines(impact: Optional[Impact]) -> list[str]:
    """Every sentence about the ranking (`record --impact`): the fix that matters most first (a multi-step
    comparison's verdict states them too: `judge/steps/step_verdict.py`)."""
    return [*_first_fix(impact), *_impact_lines(impact)]


def _apart(a, b, impact: Impact) -> float:
    key = "share" if impact.by_loss else "grad_share"
    return abs(getattr(a, key) - getattr(b, key))


def _impact_lines(impact: Optional[Impact]) -> list[str]:
    """How far a rounding moves the gaps, what every fix together leaves (the precision's part), whether the fixes
    interact, what was not fixed."""
    if impact is None or (not impact.fixes and not impact.note):
        return []  # not asked for, or nothing flagged: no ranking
    if impact.note:
        return [f"impact: {impact.note}"]
    what = "loss gap" if impact.by_loss else "gradients' gap"
    what += f" at step {impact.step}" if impact.step is not None else ""
    lines = []
    if not impact.evidence:
        return [f"impact: no ranking: one rounding of the weights moves the {what} by {_pct(impact.sensitivity)}, "
                f"as far as a fix does: this iteration is too sensitive to tell the {len(impact.fixes)} fixes apart "
                f"(the table's shares are no evidence)"]
    if impact.sensitivity > SENSITIVITY_SAID:
        lines.append(f"impact: one rounding of the weights moves the {what} by {_pct(impact.sensitivity)}: shares "
                     f"closer than that are not told apart")
    measured = [f for f in impact.fixes if f.measured]
    if measured and not math.isnan(impact.leaves):
        every = f"with all {len(impact.fixes)} fixed" if len(impact.fixes) > 1 else "with it fixed"
        if len(measured) == len(impact.fixes):
            lines.append(f"impact: {every}, the precision alone leaves {_pct(impact.leaves)} of the {what}")
        else:
            lines.append(f"impact: {every} ({len(impact.fixes) - len(measured)} could not be: below), "
                         f"{_pct(impact.leaves)} of the {what} is left")
    if impact.interacts:
        lines.append(f"impact: the shares of the {len(measured)} fixes add up to {_pct(impact.total)}, all of them "
                     f"together close {_pct(1 - impact.leaves)}: the fixes interact (each share is measured with "
                     f"the other calls as they are)")
    if impact.top is not None and impact.num_flagged > len(impact.fixes):
        lines.append(f"impact: the {len(impact.fixes)} largest own errors of {impact.num_flagged} flagged calls "
                     f"were fixed (--impact-top {impact.top})")
    missed = [f for f in impact.fixes if not f.measured]
    if missed:
        lines.append("impact: " + "; ".join(f"{f.name} {f.note or 'not measured'}" for f in missed))
    return lines


def _first_divergence_line(first: dict) -> str:
    """The first entry outside tolerance, labelled as such: with local data it is seldom the culprit."""
    size = f" (rel_l2 {sci(first.get('rel_l2'))})" if num(first.get("rel_l2")) is not None else ""
    if _nonfinite_differs(first) and first.get("num_nan_ref") is not None:
        size = f" ({_nan_inf(first)})"
    drift = {"drift": ": accumulated drift, which the verdict does not rest on",
             "rounding": ": its own call's rounding (computed from values bitwise the reference's), within its "
                         "noise"}.get(str(first.get("entry_status")), "")
    if first.get("entry_status") == "rounding" and str(first.get("reason") or "").startswith(ROUNDING_VALUE):
        drift = ": rounding itself (its precision's own error for it is as large as the value), within its noise"
    return (f"first divergence: #{first.get('index')} {entry_name(first)}{size}, the first entry outside "
            f"tolerance{drift}")


def _basis_line(v: Verdict) -> str:
    if v.basis == "first_divergence":
        at = "" if v.where.get("index") is None else f", #{v.where['index']}"
        return (f"basis: first divergence in causal order{at} (no per-layer local data: record the target with "
                f"--replay, or --against cpu, to judge each call's own error)")
    kind = "teacher-forced replay" if v.local_kind == "teacher_forced" else "recomputation on the CPU in float32"
    return (f"basis: each call's own error ({kind}): {v.num_local} tensors of {v.num_local_calls} calls "
            f"judged, {v.num_flagged} above their expected noise")


def _compiled_lines(c: Optional[dict]) -> list[str]:
    """Which side ran compiled blocks, what compiling cost, its graph breaks, and what the blocks hide."""
    if not c:
        return []
    lines = []
    for side in ("target", "reference"):
        info = c.get(side) or {}
        blocks = info.get("blocks") or {}
        if not blocks:
            continue
        each = "; ".join(f"{path or ROOT_MODULE} ({b.get('backend', '?')}, "
                         f"{_count(b.get('graphs'), 'graph') if b.get('graphs') else 'no new graph'})"
                         for path, b in list(blocks.items())[:6])
        more = f"; {len(blocks) - 6} more" if len(blocks) > 6 else ""
        breaks = info.get("graph_breaks") or []
        rerun = num(info.get("rerun_compile_seconds")) or 0.0  # what `record` printed is the sum of both
        reruns = f" (+{rerun:.1f} s for its reruns)" if rerun else ""
        lines.append(f"compiled: the {side} ran {_count(len(blocks), 'compiled block')}: {each}{more}; "
                     f"{_count(len(breaks), 'graph break')}, {num(info.get('compile_seconds')) or 0.0:.1f} s "
                     f"compiling{reruns}, not in its record time")
        for gb in breaks[:5]:
            block = "the iteration" if gb.get("block") is None else gb["block"] or ROOT_MODULE
            lines.append(f"compiled: graph break in {block} at {gb.get('where')}: {gb.get('reason')}")
        for path, b in list(blocks.items())[:6]:
            if b.get("eager"):
                lines.append(f"compiled: {path or ROOT_MODULE} in the {side}: {b['eager']}")
        lines += random_lines(info, side)
    for side, other in (("target", "reference"), ("reference", "target")):
        hidden = [h for h in c.get("hidden") or [] if h.get("side") == side]
        if not hidden:
            continue
        entries, calls = sum(int(h.get("entries") or 0) for h in hidden), sum(int(h.get("calls") or 0) for h in hidden)
        each = ", ".join(f"{h.get('block') or ROOT_MODULE} {h.get('entries')}" for h in hidden[:6])
        lines.append(f"compiled: {_count(entries, 'entry', 'entries')} of {_count(calls, 'call')} the {other} "
                     f"recorded inside the {side}'s compiled blocks ({each}) are not compared: of a compiled block "
                     f"only its inputs, outputs and their gradients, and its parameters' gradients and updates are "
                     f"observable, not the calls inside it")
    return lines


def _count(n, one: str, many: str = "") -> str:
    n = int(n or 0)
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _precision_lines(p: Optional[dict]) -> list[str]:
    """What each side ran in a reduced float32 precision (TF32 convolutions...), and how the noise accounts for it."""
    if not p:
        return []
    cal = p.get("calibrated") or {}
    lines = []
    for side in ("target", "reference"):
        ran = describe(p.get(side) or {})
        if not ran:
            continue
        emulated = reduced(cal.get(side) or {})
        calls = int(cal.get(f"{side}_calls") or 0)
        modes = "/".join(sorted({m.upper() for m in emulated.values()}))
        if emulated:
            how = f"the noise of {calls} calls calibrated with {modes} operands" if calls else \
                f"reproduced with {modes} operands, but no call needed calibration"
        elif side == "target":
            how = "calibrated on the device, which runs them so" if cal.get("where") == "device" else "not reproduced"
        elif reduced(p.get("reference")) == reduced(p.get("target")):
            how = "as the target: the target's noise stands for it"
        else:
            how = "finer than the target's precision: its noise is not measured"
        lines.append(f"precision: the {side} ran float32 {ran}: {how}")
    return lines


def _local_lines(v: Verdict) -> list[str]:
    """The culprit's surroundings and what no probe saw."""
    lines = []
    if v.culprit_includes:
        names = ", ".join(f"{u['module']}@{u['call']}" for u in v.culprit_includes)
        lines.append(f"the culprit's rerun includes {names}, which could not be probed alone (see below): the "
                     f"difference may be there")
    chain = v.chain
    if len(chain) > 1:
        outer = " < ".join(f"{c['module']}@{c['call']}" for c in chain[1:])
        within = not any(c["flagged"] for c in chain[1:])
        lines.append(f"inside: {outer}" + (" (their own code is within noise)" if within else ""))
    unprobed = v.unprobed
    if unprobed:
        shown = "; ".join(f"{u['module']}@{u['call']}: {u['reason']}" for u in unprobed[:3])
        more = f"; {len(unprobed) - 3} more in the JSON report" if len(unprobed) > 3 else ""
        lines.append(f"not probed ({len(unprobed)} calls, judged by error growth only): {shown}{more}")
    return lines


def _untrusted_lines(untrusted: tuple[dict, ...]) -> list[str]:
    """Every call whose calibration was not trusted, with both figures (the first few; all in the JSON report)."""
    if not untrusted:
        return []
    shown = "; ".join(f"{entry_name(u)}: {_noise_claim(u.get('calibration'), u.get('calibrated'), u.get('expected'))}"
                      f" ({'flagged' if u.get('flagged') else 'within that'} with its own error "
                      f"{sci(u.get('rel_l2'))})" for u in untrusted[:3])
    more = f"; {len(untrusted) - 3} more in the JSON report" if len(untrusted) > 3 else ""
    return [f"calibration not trusted ({len(untrusted)} tensors): {shown}{more}"]


# -- several ranks --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankedVerdict:
    """The verdict over the ranks of a torchrun recording: a divergence if any rank diverged, naming the rank whose
    divergence comes first in causal order (ties: the lowest rank); inconclusive if a rank is and none diverged."""

    status: str
    rank: Optional[int]
    num_ranks: int
    diverged_ranks: tuple[int, ...]
    headline: str
    note: Optional[str]
    """Why other ranks diverge only from param_grad on (gradients are averaged over ranks), when they do."""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


def decide_ranked(verdicts: dict[int, Verdict]) -> RankedVerdict:
    """Combine one Verdict per rank (ascending ranks); of multi-step recordings (`StepVerdict`s, which name a
    `step`), the rank whose first step outside the band comes first."""
    diverged = tuple(r for r, v in verdicts.items() if v.status == "diverged")
    inconclusive = [r for r, v in verdicts.items() if v.status == "inconclusive"]
    total = len(verdicts)

    def position(rank: int) -> tuple:
        if not isinstance(verdicts[rank], Verdict):  # multi-step recordings: the first step outside the band
            step = verdicts[rank].step
            return (math.inf if step is None else step, rank)
        index = verdicts[rank].index
        if index is None:  # a collective: where its result first shows; else after every row
            index = (verdicts[rank].entry or {}).get("order")
        return (verdicts[rank].num_entries if index is None else index, rank)

    origin = min(diverged, key=position, default=None)
    if origin is not None:
        v = verdicts[origin]
        if not isinstance(v, Verdict):
            which = f": {', '.join(map(str, diverged))}" if len(diverged) > 1 else ""
            return RankedVerdict("diverged", origin, total, diverged, f"DIVERGED on rank {origin} at step {v.step} "
                                 f"({len(diverged)} of {total} ranks diverged{which})", None)
        where = f" at {entry_name(v.entry)}" if v.entry and v.entry.get("module") is not None else f": {v.headline}"
        if v.focus == "collective":
            c = v.entry["collective"]
            where = f" at {c.get('kind', 'collective')} {c['name']}"
        which = f": {', '.join(map(str, diverged))}" if len(diverged) > 1 else ""
        headline = f"DIVERGED on rank {origin}{where} ({len(diverged)} of {total} ranks diverged{which})"
        return RankedVerdict("diverged", origin, total, diverged, headline, _spread_note(verdicts, origin, diverged))
    if inconclusive:
        why = verdicts[inconclusive[0]].title.removeprefix("INCONCLUSIVE: ")  # the first such rank's reason
        return RankedVerdict("inconclusive", None, total, (), f"INCONCLUSIVE on rank "
                             f"{', '.join(map(str, inconclusive))} of {total}: {why}", None)
    return RankedVerdict("match", None, total, (), f"MATCH on all {total} ranks", None)


def _spread_note(verdicts: dict[int, Verdict], origin: int, diverged: tuple[int, ...]) -> Optional[str]:
    later = [r for r in diverged if r != origin and (verdicts[r].entry or {}).get("phase") in ("param_grad",
                                                                                               "optimizer")]
    if not later:
        return None
    who = f"rank {later[0]} diverges" if len(later) == 1 else f"ranks {', '.join(map(str, later))} diverge"
    return (f"note: {who} only from param_grad on: gradients are averaged across ranks (DDP's allreduce, FSDP2's "
            f"reduce-scatter), so rank {origin}'s error reaches every rank's gradients and weights")
