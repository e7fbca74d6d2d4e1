"""`record --impact`: the iteration run again with each flagged call fixed, and the `/impact` table of their gaps.

Where this sits: a replay's Recorder (`Recorder(impact=True)` with `rec.run(fn)`) calls `measure` once the recorded
iteration is over and its calls are judged (`record/local/probe.py`), before the file is closed. From the same start
(`start.py`) the iteration runs

1. once as it is (`plain`): it must give the recorded loss bit for bit on the CPU (elsewhere the difference is kept,
   `check`), else the runs are no model of the iteration and nothing more is measured (the table says why);
2. once per candidate (`candidates.py`: each flagged call, largest own error first, at most `top`) with that call
   fixed (`fixed_call.py`: its output and input gradients what its own code computes in float64 on the trusted path
   from what it receives in that run);
3. once with every candidate fixed (`all`), when there are several: what the precision alone leaves.

Each run's loss, gradients and updated weights are measured against the reference (`gaps.py`) and kept as one row;
compare turns them into the share of the gap each fix closes (`judge/iteration/impact.py`). Cost: one iteration per
row.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from oneiter.format.schema import ImpactRow
from oneiter.record.impact.candidates import Candidate, choose
from oneiter.record.impact.fixed_call import FIXED
from oneiter.record.impact.gaps import Gaps, ReferenceGaps
from oneiter.record.impact.impact_pass import ImpactPass
from oneiter.record.impact.start import Start

__all__ = ["Impact", "measure", "one_pass", "PLAIN", "CALL", "ALL"]

PLAIN, CALL, ALL = "plain", "call", "all"  # the rows of `/impact`: nothing fixed, one call fixed, every one fixed


@dataclass
class Impact:
    """What `measure` needs of the recording: the start, one run of it (`once(targets)`: the iteration run again
    from the start with `targets` fixed, its gaps and, per target, `FIXED` or why it was not), the recorded loss the
    run with nothing fixed must give, where it ran, and a progress callback."""

    start: Start
    once: Callable[[list[tuple[str, int]]], tuple[Gaps, dict]]
    recorded_loss: float
    device_type: str = "cpu"
    progress: Callable[[str], None] | None = None
    step: int | None = None  # a multi-step replay: the step whose gaps are ranked (the last one)


def one_pass(model, ref, options, device, targets, run: Callable[[ImpactPass], None], loss_scale: float = 1.0,
             gaps: ReferenceGaps | None = None) -> tuple[Gaps, dict]:
    """The iteration of reference `ref` once more (`run(pass)` runs it), `targets` fixed: its gaps to `ref` and, per
    target, `FIXED` or why it was not (the caller swaps the start in)."""
    step = ImpactPass(model, ref, options, device, gaps or ReferenceGaps(ref, model), targets, loss_scale)
    with step:
        run(step)
    return step.gaps(), dict(step.fixes.done) if step.fixes is not None else {}


def _row(kind: str, gaps: Gaps | None, candidate: Candidate | None = None, note: str = "") -> ImpactRow:
    c = candidate
    nan = math.nan
    return ImpactRow(kind=kind, module=c.module if c else "", call=c.call if c else -1, phase=c.phase if c else "",
                     tensor=c.tensor if c else "", rel_l2=c.rel_l2 if c else nan, ratio=c.ratio if c else nan,
                     loss=gaps.loss if gaps else nan, loss_gap=gaps.loss_gap if gaps else nan,
                     grad_gap=gaps.grad_gap if gaps else nan, weight_gap=gaps.weight_gap if gaps else nan,
                     note=note)


def _once(job: Impact, targets: list[tuple[str, int]]) -> tuple[Gaps, dict]:
    with job.start.swapped_in():
        return job.once(targets)


def _note(done: dict, key: tuple[str, int]) -> str:
    if key not in done:
        return "not fixed: the call did not run"
    return "" if done[key] == FIXED else done[key]


def measure(job: Impact, judged_rows, run_dtype: str, top: int | None) -> tuple[list[ImpactRow], dict]:
    """The `/impact` rows and the table's attributes (see the module docstring)."""
    began = time.perf_counter()
    candidates, num_flagged = choose(judged_rows, run_dtype, top)
    attrs = {"num_flagged": num_flagged, "top": -1 if top is None else int(top), "recorded_loss": job.recorded_loss,
             **({"step": job.step} if job.step is not None else {})}
    if not candidates:
        return [], {**attrs, "seconds": time.perf_counter() - began}
    runs = len(candidates) + 1 + (len(candidates) > 1)
    _say(job, f"impact 1/{runs}: nothing fixed")
    plain, _ = _once(job, [])
    check = _check(plain.loss, job.recorded_loss)
    attrs.update(check=check, reference_loss=plain.reference_loss)
    if check and job.device_type == "cpu":
        why = (f"not measured: the iteration run again from its start gives loss {plain.loss!r}, the recorded one "
               f"{job.recorded_loss!r} (the iteration function has side effects of its own?)")
        return [_row(PLAIN, plain, note=why)], {**attrs, "seconds": time.perf_counter() - began}
    rows = [_row(PLAIN, plain)]
    for number, candidate in enumerate(candidates, start=2):
        _say(job, f"impact {number}/{runs}: {candidate.name} fixed")
        fixed, done = _once(job, [(candidate.module, candidate.call)])
        rows.append(_row(CALL, fixed, candidate, _note(done, (candidate.module, candidate.call))))
    if len(candidates) > 1:
        _say(job, f"impact {runs}/{runs}: all {len(candidates)} fixed")
        keys = [(c.module, c.call) for c in candidates]
        every, done = _once(job, keys)
        missed = [f"{m}@{c}: {_note(done, (m, c))}" for m, c in keys if _note(done, (m, c))]
        rows.append(_row(ALL, every, note="; ".join(missed)))
    return rows, {**attrs, "seconds": time.perf_counter() - began}


def _check(loss: float, recorded: float) -> float:
    """The relative difference between the plain run's loss and the recorded one (0: bit for bit)."""
    if loss == recorded or (math.isnan(loss) and math.isnan(recorded)):
        return 0.0
    return abs(loss - recorded) / abs(recorded) if recorded else math.inf


def _say(job: Impact, text: str) -> None:
    if job.progress is not None:
        job.progress(text)
