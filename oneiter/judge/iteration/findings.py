"""What blame found, as findings; the verdict names the one of highest priority.

Sits between the engine, which records every finding of a comparison (`CompareResult.findings`), and the verdict
(`verdict.decide`), which picks among them by `PRIORITY` alone: a new kind of evidence is one entry in that table
and one place that records it, not another branch in the order of `if`s. Within one kind the first recorded wins,
and each kind is recorded in causal order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # only for annotations: the engine's rows, blame's local results
    from oneiter.judge.iteration.blame import LocalResult
    from oneiter.judge.iteration.engine import Row

__all__ = ["PRIORITY", "UNATTRIBUTED", "MEASURED", "NOT_JUDGED", "Finding", "row_findings", "strongest", "of_kind"]

PRIORITY = {
    # a rank's first collective whose output is off the exact result of its group's recorded inputs by more than
    # the reduction noise of its dtype and group size (`collectives.py`): judged on its own inputs, with or without
    # local data, so certain evidence that the communication library is wrong; every value that consumed its
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
}
UNATTRIBUTED = ("unexplained", "loss")  # with local data, a verdict resting on these blames no call
# row statuses of entries both sides hold with one shape and dtype
MEASURED = ("match", "diverged", "drift", "rounding")
# measured and shown, never evidence: a parameter's update when the optimizers did not start from the same state
NOT_JUDGED = "not_judged"


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
        """A finding with its kind's priority from `PRIORITY` (the only place priorities are written)."""
        return cls(kind, PRIORITY[kind], entry, reason, local, collective)


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
