"""The verdict of two multi-step recordings compared: the first step outside the band, and how to record it.

Sits after the rows (`band.py`: each step's error and band) and before every writer (`report/multistep.py`, whose
verdict block, JSON findings, CSV roles and HTML banner are the one-iteration report's: `report/terminal.py`,
`report/html.py`). The same system as one iteration's verdict (`judge/iteration/findings.py`): every step outside
the band is a `step` finding (`STEP_PRIORITY`), recorded in step order; the strongest names the step; the status
follows `findings.status_of` (diverged when a step is found; inconclusive when steps could not be judged; else
match) and the exit code `verdict.EXIT_CODES`.

A step is outside when a group's error exceeds its band, or when NaN/Inf appear in its signature on one side only.
Its own computation put it there: every earlier step was within what the precision explains, and the band grows as
an error inherited from them grows. The verdict names the **first** such step (`step`, exit 1), with the two
commands that record that step in full on both sides (`record --step S`, then `record --replay`:
`runtime/commands.py`), where the one-iteration blame names the layer.

A target recorded without a twin (the Hugging Face callback, the mmengine hook, `twin=False`) has no band: each
step is then held to the tolerance of the lower precision (`torch.testing.assert_close`'s rtol), and the verdict
says so (basis `tolerance`). Steps whose every statistic is bitwise the reference's (checksums) are `bitwise`; at
the first step that is not, after bitwise steps, the first entry in causal order that differs is named too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.findings import Finding, status_of, strongest
from oneiter.judge.iteration.impact import Impact, read_impact
from oneiter.judge.iteration.verdict import EXIT_CODES, impact_lines
from oneiter.judge.stepwise.band import BAND_FACTOR, DECORRELATED, StepRow, first_entry, tolerance_band
from oneiter.runtime.commands import record_step_commands

__all__ = ["StepVerdict", "decide_steps"]

STATUSES = {"outside": "outside band", "bitwise": "bitwise", "within": "within band", "unjudged": "not judged"}


@dataclass
class StepVerdict:
    """What a comparison of two multi-step recordings says: the first step outside the band, and how to record it.

    Its words (`title`, `reason`, `details`) and `findings` are laid out by the same writers as a one-iteration
    `Verdict`'s; `as_dict()` is the JSON report's `verdict`."""

    status: str  # match, diverged or inconclusive
    basis: str  # band (the twin's) or tolerance (no twin: the lower precision's rtol)
    step: Optional[int]
    title: str
    reason: str
    details: list[str]
    warnings: list[str] = field(default_factory=list)
    commands: Optional[list[str]] = None
    first_difference: Optional[int] = None  # the first step not bitwise the reference's
    entry: Optional[str] = None  # the first entry of that step that differs, when the steps before were bitwise
    factor: float = BAND_FACTOR
    num_steps: int = 0
    findings: tuple[dict, ...] = ()
    """Every step found outside (`Finding.as_dict`; `entry`: the step's index in the report's `steps`)."""
    index: Optional[int] = None
    """The row of the step it names (None: it names none)."""
    first_difference_index: Optional[int] = None
    impact: Optional[Impact] = None
    """The calls of `record --steps N --impact --impact-from FILE` ranked by the share of the loss gap at the last
    step that fixing each at every step closes (`judge/iteration/impact.py`); None without it."""

    @property
    def focus(self) -> Optional[str]:
        """What the verdict names: `step`, or None."""
        return None if self.step is None else "step"

    @property
    def headline(self) -> str:
        return f"{self.title}: {self.reason}" if self.reason else self.title

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def lines(self) -> list[str]:
        return [self.headline, *self.details]

    def roles(self, index: int) -> list[str]:
        """What row `index` is to the verdict: `verdict` (the step it names), `first_difference`."""
        return [name for name, at in (("verdict", self.index), ("first_difference", self.first_difference_index))
                if at == index]

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "basis": self.basis, "focus": self.focus, "step": self.step,
                "headline": self.headline, "details": list(self.details), "warnings": list(self.warnings),
                "commands": self.commands, "first_difference_step": self.first_difference, "entry": self.entry,
                "band_factor": self.factor, "num_steps": self.num_steps, "findings": list(self.findings),
                "impact": self.impact.as_dict() if self.impact is not None else None}


def decide_steps(ref: IterationFile, tgt: IterationFile, rows: list[StepRow], notes: list[str]) -> StepVerdict:
    """Settle each row's status and decide: the first step outside names the verdict (module docstring)."""
    warnings = list(notes)
    basis = _basis(ref, tgt, rows, warnings)
    for row in rows:  # bitwise statistics and a signature the band does not hold: the file contradicts itself
        row.status = STATUSES["outside" if row.outside else "bitwise" if row.bitwise else
                              "within" if row.judged else "unjudged"]
    found = [Finding.of("step", i, _why(row, basis)) for i, row in enumerate(rows) if row.outside]
    top = strongest(found)
    unjudged = [r for r in rows if not r.judged]
    status = status_of(found, judged=not unjudged)
    first_diff = next((i for i, r in enumerate(rows) if not r.bitwise), None)
    entry = None
    if first_diff is not None and (first_diff == 0 or rows[first_diff - 1].bitwise):
        step = rows[first_diff].step
        entry = first_entry(ref.step(step), tgt.step(step))
    details = _basis_lines(rows, basis, unjudged)
    if first_diff is not None:
        details.append(f"first difference: step {rows[first_diff].step}" + (f", first entry {entry}" if entry else "")
                       + " (not bitwise the reference's)")
    details += [f"warning: {w}" for w in warnings]
    named = None if top is None or top.entry is None else rows[top.entry]  # a step finding names its step
    at = named if named is not None else (unjudged[0] if status == "inconclusive" else None)
    commands = None if at is None else _commands(ref, tgt, at.step)
    title, reason = _headline(status, basis, rows, named, unjudged, first_diff)
    details += _next(status, rows, named, unjudged, commands)
    impact = read_impact(tgt)
    details += impact_lines(impact)
    return StepVerdict(
        status=status, basis=basis, step=None if named is None else named.step, title=title, reason=reason,
        details=details, warnings=warnings, commands=commands,
        first_difference=None if first_diff is None else rows[first_diff].step, entry=entry, num_steps=len(rows),
        findings=tuple(f.as_dict() for f in found), index=None if top is None else top.entry,
        first_difference_index=first_diff, impact=impact)


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
        band = tolerance_band(ref, tgt)
        for row in rows:
            row.bands = dict.fromkeys(row.bands, band)
        return "tolerance"
    return "band"


def _why(row: StepRow, basis: str) -> str:
    """Why a step is outside: NaN/Inf on one side only, or its error against its band."""
    if row.nonfinite:
        return "NaN/Inf on one side only"
    return f"the error of its {row.by} {row.error:.2e} is {row.ratio:.1f}x {_short(basis)} {row.band:.2e}"


def _basis_lines(rows: list[StepRow], basis: str, unjudged: list[StepRow]) -> list[str]:
    what = "the band (what the precision explains, measured by the twin)" if basis == "band" else \
        "the tolerance of the lower precision"
    lines = [f"basis: per step, the signature's error (loss, each parameter's gradient and update norm) against "
             f"{what}; {len(rows)} steps, {sum(r.bitwise for r in rows)} bitwise, "
             f"{sum(r.outside for r in rows)} outside, {len(unjudged)} not judged"]
    skipped = sorted({g for r in rows if r.judged and not r.bitwise for g in r.errors if not r.judges(g)})
    if skipped:
        lines.append(f"{' and '.join(skipped)} not judged at some steps: their band exceeds {DECORRELATED:g} "
                     f"(the storage of the weights rounds the updates away, or runs one rounding apart drift that "
                     f"far); the other group judges those steps")
    return lines


def _headline(status: str, basis: str, rows: list[StepRow], named: Optional[StepRow], unjudged: list[StepRow],
              first_diff: Optional[int]) -> tuple[str, str]:
    if status == "diverged":
        assert named is not None  # a divergence rests on a step finding, which names its step
        return f"DIVERGED at step {named.step}", _why(named, basis)
    if status == "match":
        return (f"MATCH: all {len(rows)} steps bitwise the reference's" if first_diff is None else
                f"MATCH: {len(rows)} steps, every step's error within {_short(basis)}"), ""
    first = unjudged[0]
    before = [r.step for r in rows if r.step < first.step]
    shown = "" if not before else f"step {before[0]} within {_short(basis)}, then " if len(before) == 1 else \
        f"steps {before[0]}-{before[-1]} within {_short(basis)}, then "
    drift = min(b for b in first.bands.values() if b is not None) / BAND_FACTOR
    return (f"INCONCLUSIVE from step {first.step}", f"{shown}the band exceeds {DECORRELATED:g}: runs one rounding "
            f"apart drift {drift:.1%} apart by step {first.step}, so a step's own error can no longer be told from "
            f"what it inherited")


def _next(status: str, rows: list[StepRow], named: Optional[StepRow], unjudged: list[StepRow],
          commands: Optional[list[str]]) -> list[str]:
    """What to do next: record the named step (or, inconclusive, a later one) in full on both sides."""
    lines = []
    if status == "inconclusive":
        first = unjudged[0].step
        lines.append(f"judge a later step on its own: record it in full on both sides (step {first} here; any "
                     f"step S the same way, with --step S), then compare them" + (":" if commands else ""))
        return lines + [f"  {c}" for c in commands or []]
    if named is None:
        return lines
    earlier = [r.step for r in unjudged if r.step < named.step]
    if earlier:
        lines.append(f"steps {_listed(earlier)} before it were not judged (their band exceeds {DECORRELATED:g}): "
                     f"the first step that went wrong may be one of them")
    if commands:
        lines.append(f"record step {named.step} in full on both sides, then compare them (the layer is named):")
        return lines + [f"  {c}" for c in commands]
    lines.append(f"record step {named.step} in full on both sides: oneiter.Recorder around iteration {named.step} "
                 f"of the reference's loop (after {named.step} plain iterations), then the target's with replay= "
                 f"that file; oneiter compare names the layer")
    return lines


def _commands(ref: IterationFile, tgt: IterationFile, step: int) -> Optional[list[str]]:
    """The two commands that record `step` in full on both sides, from the files' first steps' metadata."""
    first_ref, first_tgt = ref.step(ref.steps()[0]), tgt.step(tgt.steps()[0])
    return record_step_commands(first_ref.meta, first_tgt.meta, ref.path, tgt.path, step)


def _listed(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 1 else \
        ", ".join(map(str, steps))


def _short(basis: str) -> str:
    return "the band" if basis == "band" else "the tolerance"
