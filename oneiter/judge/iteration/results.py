"""What one comparison of two recordings holds: `CompareResult`, its rows, findings and notes, and the verdict
decided from them, and its JSON form.

The engine (`engine.py`) builds one from two files: the measured rows first, then, by keyword, the same result with
what blame and the findings (`blame.py`, `findings.py`) found and its rows settled; the verdict (`verdict.py`, which
reads a result as `verdict.Evidence`) is decided once, the first time it is asked for; every report
(`oneiter.report`) and the public API read it. The rows themselves are `entries.py`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

from oneiter.formatting import json_ready
from oneiter.judge.iteration.entries import STATUSES, Key, LocalResult, Row
from oneiter.judge.iteration.findings import Finding
from oneiter.judge.iteration.impact import Impact
from oneiter.judge.iteration.verdict import Culprit, Verdict, decide

__all__ = ["CompareResult"]


@dataclass
class CompareResult:
    """Rows in causal order, the index of the first entry outside tolerance (None: none is), what blame found, and
    the verdict decided from them once (`verdict_obj`: `judge/iteration/verdict.py` decides it)."""

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
    the other side recorded inside a block, which are not compared (`pairing.hidden`); None when neither compiled."""
    rounding: set[int] = field(default_factory=set)
    """Rows outside tolerance computed from values all bitwise the reference's, whose error is their own code's
    and within its noise (`blame.own_values`), and every row stored as the same pair of datasets (a layer's output
    is the next one's input): `rounding`, never drift."""
    stored: list = field(default_factory=list, repr=False)
    """Per row, the identity of the pair of datasets it compares (hard links share one); None when unmeasured."""
    microbatches: dict[tuple[str, int], int] = field(default_factory=dict)
    """(module, call) -> the microbatch whose forward made the call, for an iteration of several microbatches
    (gradient accumulation: docs/format.md "Microbatches"); {} for one of a single microbatch."""
    microbatch_loss: dict[str, list[float]] = field(default_factory=dict)
    """Each side's loss of each microbatch (`reference`, `target`), for an iteration of several; {} otherwise."""
    impact: Optional[Impact] = None
    """The flagged calls ranked by the share of the gap fixing each closes (`record --impact`); None without it."""

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
        if self.microbatches:  # an iteration of several microbatches: the row's call's (None: no call's row)
            head["microbatch"] = self.microbatches.get((head["module"], head["call"])) if head["phase"] in (
                "forward", "backward") else None
        return {"index": index, **head, "role": role, **data}

    def as_dict(self) -> dict[str, Any]:
        """The machine-readable report's data: verdict, inputs, per-status counts and every row in causal order
        with its local result (non-finite numbers still floats: `to_json` is what JSON can hold)."""
        rows = [{**self.row_dict(i), "local": _local_dict(self.local_for(row))} for i, row in enumerate(self.rows)]
        return {
            "verdict": self.verdict(),
            "impact": [f.as_dict() for f in self.impact.fixes] if self.impact is not None else None,
            "reference": self.reference,
            "target": self.target,
            "meta": {"reference": self.meta_reference, "target": self.meta_target},
            "loss": self.loss,
            **({"microbatch_loss": self.microbatch_loss} if self.microbatch_loss else {}),
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
    def _local_index(self) -> dict[Key, LocalResult]:
        return {r.row_key: r for r in self.local}

    def local_for(self, row: Row) -> Optional[LocalResult]:
        """The local error measured for the same (module, call, phase, tensor) as an accumulated row."""
        return self._local_index.get(row.key)


def _local_dict(local: Optional[LocalResult]) -> Optional[dict[str, Any]]:
    return None if local is None else local.as_dict()
