"""What a comparison found, as findings; the verdict names the one of highest priority.

Sits between what records the evidence and the verdict that picks among it by priority alone (`PRIORITY`;
`STEP_PRIORITY` for steps): one iteration's engine and blame record theirs in `CompareResult.findings`
(`verdict.decide` picks), two multi-step recordings' steps theirs in the steps verdict (`judge/stepwise/
step_verdict.py`). A new kind of evidence is one entry in a table and one place that records it, not another
branch in the order of `if`s. Within one kind the first recorded wins, and each kind is recorded in causal order
(the order of the entries, or of the steps). Both verdicts take their status from the same rule (`status_of`)
and give their findings to JSON in the same shape (`Finding.as_dict`: the report's `verdict.findings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from oneiter.judge.iteration.entries import MEASURED, NOT_JUDGED, LocalResult, Row

__all__ = ["PRIORITY", "STEP_PRIORITY", "UNATTRIBUTED", "INCONCLUSIVE", "Finding", "row_findings", "strongest",
           "of_kind", "status_of"]

PRIORITY = {
    # a rank's first collective whose output is off the exact result of its group's recorded inputs by more than
    # the reduction noise of its dtype and group size (`collective_verdict.py`): judged on its own inputs, with or
    # without local data, so certain evidence that the communication library is wrong; every value that consumed its
    # result (a layer's rerun got the reference's, an accumulated entry did not) is downstream of it
    "collective": 70,
    # no local data: the first entry outside tolerance in causal order is the verdict (recorded only then)
    "first_divergence": 60,
    # an entry missing on one side, of another shape or dtype: the runs did not even compute the same things
    "structural": 50,
    # the first call whose own code's error exceeds its expected noise, or that makes NaN/Inf of its own
    "culprit": 40,
    # NaN/Inf at other positions than in the reference, with no call to blame for it
    "nan_inf": 30,
    # local data, no call to blame, but an entry no probe covers differs more than the precision explains
    "unexplained": 20,
    # the loss differs more than the model's outputs explain (or, without local data, outside its tolerance)
    "loss": 10,
    # a call's calibrated noise is far above what its precision can produce (its own error within what can): the
    # call is neither cleared nor blamed, so nothing else found, the verdict is no match (`INCONCLUSIVE`)
    "calibration": 5,
}
# two multi-step recordings compared step by step (`judge/stepwise/step_verdict.py`), chosen among by the same rule
STEP_PRIORITY = {
    # a step whose signature leaves the band, or holds NaN/Inf on one side only: recorded for every such step, in
    # step order, so the verdict names the first
    "step": 10,
}
_PRIORITIES = {**PRIORITY, **STEP_PRIORITY}
UNATTRIBUTED = ("unexplained", "loss")  # with local data, a verdict resting on these blames no call
INCONCLUSIVE = ("calibration",)  # a verdict resting on these is inconclusive: evidence neither way


@dataclass(frozen=True)
class Finding:
    """One piece of evidence that the runs diverge.

    `entry` is the row it names (None: the loss, a collective, or a culprit tensor the report has no row for);
    `reason` says why in words; `local` is the culprit's local result, `collective` the judged collective
    (`collectives.Judged.as_dict()` with its `order`), None for every other kind.
    """

    kind: str
    priority: int
    entry: Optional[int]
    reason: str = ""
    local: Optional[LocalResult] = None
    collective: Optional[dict] = None

    @classmethod
    def of(cls, kind: str, entry: Optional[int], reason: str = "", local: Optional[LocalResult] = None,
           collective: Optional[dict] = None) -> Finding:
        """A finding with its kind's priority from `PRIORITY` or `STEP_PRIORITY` (the only place priorities are
        written)."""
        return cls(kind, _PRIORITIES[kind], entry, reason, local, collective)

    def as_dict(self) -> dict[str, Any]:
        """What the JSON report's `verdict.findings` holds of it: kind, priority, entry (the index of the row, or
        of the step, it names; None: the loss) and reason."""
        return {"kind": self.kind, "priority": self.priority, "entry": self.entry, "reason": self.reason}


def row_findings(rows: list[Row], first_divergence: Optional[int], has_local: bool) -> list[Finding]:
    """What the rows alone show: without local data the first divergence; structural differences (statuses the
    engine set for entries it could not measure) and NaN/Inf differences, each in causal order (rows not judged are
    no evidence)."""
    found = [] if has_local or first_divergence is None else [
        Finding.of("first_divergence", first_divergence, rows[first_divergence].reason)]
    judged = [(i, row) for i, row in enumerate(rows) if row.status != NOT_JUDGED]
    found += [Finding.of("structural", i, row.reason) for i, row in judged if row.status not in MEASURED]
    found += [Finding.of("nan_inf", i, row.reason) for i, row in judged
              if row.metrics is not None and row.metrics.nonfinite_differs]
    return found


def strongest(findings: list[Finding]) -> Optional[Finding]:
    """The finding the verdict names: the highest priority; of equals, the first recorded."""
    return max(findings, key=lambda f: f.priority, default=None)


def of_kind(findings: list[Finding], kind: str) -> list[Finding]:
    return [f for f in findings if f.kind == kind]


def status_of(findings: list[Finding], *, judged: bool) -> str:
    """A verdict's status: `diverged` when anything was found (`inconclusive` when the strongest finding is evidence
    neither way, `INCONCLUSIVE`: a calibration not trusted), else `inconclusive` when what had to be judged was not
    (local data, but no call's own error measured; steps whose band is too wide to judge), else `match`."""
    top = strongest(findings)
    if top is not None:
        return "inconclusive" if top.kind in INCONCLUSIVE else "diverged"
    return "match" if judged else "inconclusive"
