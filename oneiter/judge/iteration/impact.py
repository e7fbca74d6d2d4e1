"""Which fix matters: the flagged calls ranked by the share of the gap fixing each one closes (`record --impact`).

Where this sits: the engine reads the target's `/impact` table (`record/impact/runs.py`: one run of the iteration from
its start with nothing fixed, one per flagged call with that call fixed, one with all fixed, each with its loss,
gradient and updated-weight gaps to the reference) into an `Impact`; the verdict states its first fix
(`verdict.py`), and every report lays out the ranking (`report/impact_table.py`). A call's **share** of a gap is

    share = (gap with nothing fixed - gap with the call fixed) / gap with nothing fixed

for the loss (`share`), the parameter gradients (`grad_share`) and the updated weights (`weight_share`): 1 closes the
gap, 0 leaves it, below 0 widens it. Calls are ranked by their loss share, largest first (by their gradients' share
when the loss is the reference's bit for bit); calls that could not be fixed come last. The run with every call fixed
says what the precision alone leaves (`leaves`); shares that do not add up to what all fixes close together mean
the fixes interact (each was measured with the others in place).

**How far a rounding moves the gaps.** One more run, nothing fixed, its weights perturbed by one rounding of the
run's precision, says how sensitive the gaps are (`sensitivity`: the share of the gap that perturbation moves, either
way). Shares closer than that are not told apart; where it reaches `NO_EVIDENCE` the gaps move as far under a
rounding as under a fix (a BatchNorm over a few samples of a 1x1 map amplifies either), and the ranking is no
evidence of which fix matters: the verdict says so instead of naming one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from oneiter.format.layout import IterationFile
from oneiter.format.schema import ImpactRow
from oneiter.formatting import num

__all__ = ["Fix", "Impact", "read_impact", "share", "INTERACTION", "NO_EVIDENCE"]

INTERACTION = 0.1  # shares adding up to more than this off what all fixes close together: the fixes interact
NO_EVIDENCE = 0.5  # one rounding of the weights moving the gap by this share of it or more: the ranking says nothing


def share(before: float, after: float) -> float:
    """The share of the gap `before` that a fix leaving `after` closes (NaN: no gap to close, or not measured)."""
    if not (math.isfinite(before) and math.isfinite(after)) or before <= 0:
        return math.nan
    return (before - after) / before


@dataclass(frozen=True)
class Fix:
    """One flagged call fixed, and how much of each gap that closed."""

    module: str
    call: int
    phase: str
    tensor: str
    """Its largest flagged row (`output`, `grad_input.0`, a child's `x@0:input.0`, a parameter's name)."""
    rel_l2: float
    """Its own error (that row's local rel_l2), and below its ratio to its expected noise."""
    ratio: float
    share: float
    grad_share: float
    weight_share: float
    loss_gap: float
    """The gaps left with the call fixed: |loss - loss_ref|, the gradients' and the updated weights' rel_l2."""
    grad_gap: float
    weight_gap: float
    note: str = ""
    """Why the call was not fixed ("" when it was)."""

    @property
    def name(self) -> str:
        return f"{self.module}@{self.call}"

    @property
    def measured(self) -> bool:
        return not self.note and not math.isnan(self.loss_gap)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Fix":
        values: dict[str, Any] = {f.name: d.get(f.name) for f in fields(cls)}
        for key in ("rel_l2", "ratio", "share", "grad_share", "weight_share", "loss_gap", "grad_gap", "weight_gap"):
            values[key] = _float(values[key])
        values["call"], values["note"] = int(values["call"] or 0), str(values["note"] or "")
        return cls(**values)


def _float(value: Any) -> float:
    v = num(value)
    return math.nan if v is None else v


@dataclass(frozen=True)
class Impact:
    """The ranking of one `record --impact` replay (see the module docstring)."""

    fixes: tuple[Fix, ...]
    """Largest share first; calls not fixed last."""
    plain: dict
    """The gaps with nothing fixed: loss_gap, grad_gap, weight_gap (and the run's loss)."""
    every: Optional[dict]
    """The gaps with every call fixed, and their shares (share, grad_share, weight_share); None: not measured."""
    num_flagged: int
    top: Optional[int]
    note: str = ""
    """Why nothing was measured ("" when it was)."""
    step: Optional[int] = None
    """Over several steps: the step whose gaps are ranked (each call fixed at every step up to it)."""
    perturbed: Optional[dict] = None
    """The gaps with nothing fixed and the weights perturbed by one rounding, and their shares (signed)."""

    @property
    def by_loss(self) -> bool:
        """Whether the ranking is by the loss's share (else by the gradients': the loss was bit for bit)."""
        return _float(self.plain.get("loss_gap")) > 0

    @property
    def leaves(self) -> float:
        """The share of the loss gap (the gradients' when ranked by them) that every fix together leaves: what the
        precision alone explains."""
        if self.every is None:
            return math.nan
        return 1.0 - _float(self.every.get("share" if self.by_loss else "grad_share"))

    @property
    def sensitivity(self) -> float:
        """The share of the gap one rounding of the weights moves, either way (NaN: not measured)."""
        if self.perturbed is None:
            return math.nan
        return abs(_float(self.perturbed.get("share" if self.by_loss else "grad_share")))

    @property
    def evidence(self) -> bool:
        """Whether the gaps move less under a rounding than `NO_EVIDENCE` of them (else the ranking says nothing)."""
        return not self.sensitivity >= NO_EVIDENCE

    @property
    def total(self) -> float:
        """The shares of the calls fixed one at a time, added up."""
        key = "share" if self.by_loss else "grad_share"
        values = [getattr(f, key) for f in self.fixes if f.measured]
        return sum(values) if values and all(math.isfinite(v) for v in values) else math.nan

    @property
    def interacts(self) -> bool:
        """Whether the shares add up to more than `INTERACTION` off what all fixes close together."""
        together = 1.0 - self.leaves
        return len([f for f in self.fixes if f.measured]) > 1 and abs(self.total - together) > INTERACTION

    def as_dict(self) -> dict[str, Any]:
        return {"fixes": [f.as_dict() for f in self.fixes], "plain": dict(self.plain),
                "every": None if self.every is None else dict(self.every), "num_flagged": self.num_flagged,
                "top": self.top, "note": self.note, "step": self.step,
                "perturbed": None if self.perturbed is None else dict(self.perturbed), "leaves": self.leaves,
                "sensitivity": self.sensitivity, "evidence": self.evidence, "interacts": self.interacts}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> Optional["Impact"]:
        """The Impact of a saved JSON report (None where it holds none)."""
        if not d:
            return None
        return cls(fixes=tuple(Fix.from_dict(f) for f in d.get("fixes") or ()), plain=dict(d.get("plain") or {}),
                   every=dict(d["every"]) if d.get("every") else None, num_flagged=int(d.get("num_flagged") or 0),
                   top=None if d.get("top") is None else int(d["top"]), note=str(d.get("note") or ""),
                   step=None if d.get("step") is None else int(d["step"]),
                   perturbed=dict(d["perturbed"]) if d.get("perturbed") else None)


def _gaps(row: ImpactRow) -> dict:
    return {"loss": row.loss, "loss_gap": row.loss_gap, "grad_gap": row.grad_gap, "weight_gap": row.weight_gap}


def _shares(plain: ImpactRow, row: ImpactRow) -> dict:
    return {"share": share(plain.loss_gap, row.loss_gap), "grad_share": share(plain.grad_gap, row.grad_gap),
            "weight_share": share(plain.weight_gap, row.weight_gap)}


def read_impact(tgt: IterationFile) -> Optional[Impact]:
    """The target's ranking (None when it was not recorded with `--impact`)."""
    found = tgt.impact()
    if found is None:
        return None
    rows, attrs = found
    recorded_top = int(attrs.get("top", -1))
    top = None if recorded_top < 0 else recorded_top
    flagged = int(attrs.get("num_flagged", 0))
    step = int(attrs["step"]) if "step" in attrs else None
    plain = next((r for r in rows if r.kind == "plain"), None)
    if plain is None:
        return Impact(fixes=(), plain={}, every=None, num_flagged=flagged, top=top, step=step)
    if plain.note:
        return Impact(fixes=(), plain=_gaps(plain), every=None, num_flagged=flagged, top=top, note=plain.note,
                      step=step)
    calls = [r for r in rows if r.kind == "call"]
    fixes = [Fix(module=r.module, call=r.call, phase=r.phase, tensor=r.tensor, rel_l2=r.rel_l2, ratio=r.ratio,
                 **_shares(plain, r), loss_gap=r.loss_gap, grad_gap=r.grad_gap, weight_gap=r.weight_gap, note=r.note)
             for r in calls]
    every = next((r for r in rows if r.kind == "all"), calls[0] if len(calls) == 1 else None)
    perturbed = next((r for r in rows if r.kind == "perturbed"), None)
    by_loss = plain.loss_gap > 0
    fixes.sort(key=lambda f: _rank(f, by_loss))
    return Impact(fixes=tuple(fixes), plain=_gaps(plain),
                  every=None if every is None else {**_gaps(every), **_shares(plain, every), "note": every.note},
                  num_flagged=flagged, top=top, step=step,
                  perturbed=None if perturbed is None else {**_gaps(perturbed), **_shares(plain, perturbed)})


def _rank(fix: Fix, by_loss: bool) -> tuple:
    value = fix.share if by_loss else fix.grad_share
    return (not fix.measured or math.isnan(value), -value if not math.isnan(value) else 0.0, fix.module, fix.call)
