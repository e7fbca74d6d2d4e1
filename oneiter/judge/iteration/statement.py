"""What a verdict states: the `Verdict` (and its `Culprit`), its JSON form, and its headline and details
(`render`), which every report prints; `RankedVerdict`, the verdict over the ranks of a torchrun recording.

Between the sentences (`sentences.py`, each made from plain values) and the decision (`verdict.py`, which fills a
`Verdict` from a comparison's evidence). A saved JSON report's verdict comes back through `Verdict.from_dict` and is
rendered again, so the terminal, JSON, HTML and TensorBoard say the same words. `FOCUS` is what a verdict calls the
entry it names, by the kind of the finding it rests on; `EXIT_CODES` what each status exits with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple, Optional

from oneiter.formatting import num
from oneiter.judge.iteration.impact import Impact
from oneiter.judge.iteration.recipe_costs import lines as format_lines
from oneiter.judge.iteration.recipe_costs import recipe_error
from oneiter.judge.iteration.sentences import (
    compiled_lines,
    entry_name,
    first_divergence_line,
    first_fix,
    numbers,
    own_error,
    precision_lines,
    ranking_lines,
    untrusted_lines,
)

__all__ = ["EXIT_CODES", "FOCUS", "Culprit", "Verdict", "Sentences", "render", "RankedVerdict"]

# inconclusive: recordings that cannot be judged are bad input for judging (2), never a pass; 3 is an internal error
EXIT_CODES = {"match": 0, "diverged": 1, "inconclusive": 2}
# what the verdict calls the entry it names, by the kind of the finding it rests on (`findings.PRIORITY`)
FOCUS = {"first_divergence": "first divergence", "structural": "structural difference", "collective": "collective",
         "culprit": "culprit", "nan_inf": "NaN/Inf difference", "unexplained": "unexplained entry", "loss": "loss",
         "calibration": "calibration not trusted"}


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
        values: dict[str, Any] = {f.name: d.get(f.name) for f in fields(cls)}
        numbers = ("local_rel_l2", "expected", "ratio", "calibrated", "format_cost")
        values.update({k: num(values[k]) for k in numbers})
        return cls(**values)


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
    out because they run inside the other side's compiled blocks (`pairing.hidden`); None: neither compiled."""
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
        saved: dict[str, Any] = {
            **own, "entry": None if unnamed else where,
            "culprit": Culprit.from_dict(d["culprit"]) if d.get("culprit") else None,
            **{name: tuple(d.get(name) or ()) for name in ("chain", "culprit_includes", "unprobed", "unexplained",
                                                           "warnings", "untrusted", "findings")},
            "largest_rel_l2": num(d.get("largest_rel_l2")), "num_not_judged": int(d.get("num_not_judged") or 0),
            "num_rounding_values": int(d.get("num_rounding_values") or 0),
            "impact": Impact.from_dict(d.get("impact")),
        }
        verdict = cls(**saved)
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
    return f"DIVERGED at {entry_name(where)}", numbers(where)


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
    return own_error(c.tensor, c.local_rel_l2, c.ratio, c.expected, c.nan_mismatch, c.calibrated)


def _details(v: Verdict) -> list[str]:
    lines = [*first_fix(v.impact), *([v.hint] if v.hint else [])]
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
    lines += compiled_lines(v.compiled)
    if v.basis != "first_divergence":
        lines += precision_lines(v.precision)
        lines += _local_lines(v)
        lines += untrusted_lines(v.untrusted)
        lines += format_lines(v.formats)
    lines += ranking_lines(v.impact)
    if v.first_divergence and v.basis != "first_divergence":  # that basis line names it already
        lines.append(first_divergence_line(v.first_divergence))
    return lines


def _basis_line(v: Verdict) -> str:
    if v.basis == "first_divergence":
        at = "" if v.where.get("index") is None else f", #{v.where['index']}"
        return (f"basis: first divergence in causal order{at} (no per-layer local data: record the target with "
                f"--replay, or --against cpu, to judge each call's own error)")
    kind = "teacher-forced replay" if v.local_kind == "teacher_forced" else "recomputation on the CPU in float32"
    return (f"basis: each call's own error ({kind}): {v.num_local} tensors of {v.num_local_calls} calls "
            f"judged, {v.num_flagged} above their expected noise")


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
