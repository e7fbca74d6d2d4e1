"""`record --impact`: the iteration run again with each flagged call fixed, and the `/impact` table of their gaps.

Where this sits: a replay's Recorder (`Recorder(impact=True)` with `rec.run(fn)`) calls `measure` once the recorded
iteration is over and its calls are judged (`record/local/probe.py`), before the file is closed. From the same start
(`start.py`) the iteration runs

1. once as it is (`plain`): it must give the recorded loss bit for bit on the CPU (elsewhere the difference is kept,
   `check`), else the runs are no model of the iteration and nothing more is measured (the table says why);
2. once per candidate (`candidates.py`: each flagged call, largest own error first, at most `top`) with that call
   fixed (`fixed_call.py`: its output and input gradients what its own code computes in float64 on the trusted path
   from what it receives in that run);
3. once with every candidate fixed (`all`), when there are several: what the precision alone leaves;
4. once with nothing fixed and the weights perturbed by one rounding of the run's precision (`perturbed`,
   `impact_pass.py`): how far a rounding moves each gap — shares closer than that are not told apart, and where it
   moves them as far as the fixes do, the ranking is no evidence (compare says so).

Each run's loss, gradients and updated weights are measured against the reference (`gaps.py`) and kept as one row;
compare turns them into the share of the gap each fix closes (`judge/iteration/impact.py`). Cost: one iteration per
row.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from oneiter.format.schema import PRECISION_MODES, ImpactRow
from oneiter.record.impact.candidates import Candidate, choose
from oneiter.record.impact.fixed_call import FIXED
from oneiter.record.impact.gaps import Gaps, ReferenceGaps
from oneiter.record.impact.impact_pass import ImpactPass
from oneiter.record.impact.start import Start
from oneiter.runtime import precision_modes
from oneiter.runtime.precision import amp_dtype_name, unit_roundoff

__all__ = ["Impact", "measure", "one_pass", "perturbation", "PLAIN", "CALL", "ALL", "PERTURBED"]

# the rows of `/impact`: nothing fixed, one call fixed, every one fixed, nothing fixed and the weights perturbed
PLAIN, CALL, ALL, PERTURBED = "plain", "call", "all", "perturbed"


@dataclass
class Impact:
    """What `measure` needs of the recording: the start, one run of it (`once(targets)`: the iteration run again
    from the start with `targets` fixed, its gaps and, per target, `FIXED` or why it was not), the recorded loss the
    run with nothing fixed must give, where it ran, and a progress callback."""

    start: Start
    once: Callable[..., tuple[Gaps, dict]]  # once(targets, perturb=u, expected=...): `one_pass`'s keywords
    recorded_loss: float
    device_type: str = "cpu"
    progress: Callable[[str], None] | None = None
    step: int | None = None  # a multi-step replay: the step whose gaps are ranked (the last one)
    roundoff: float = 0.0  # the unit roundoff of the coarser run's precision: the perturbed run's


def one_pass(model, ref, options, device, targets, run: Callable[[ImpactPass], None], loss_scale: float = 1.0,
             gaps: ReferenceGaps | None = None, *, perturb: float = 0.0, optimizers=(),
             expected: dict | None = None) -> tuple[Gaps, dict]:
    """The iteration of reference `ref` once more (`run(pass)` runs it), `targets` fixed (or the weights perturbed by
    one rounding `perturb`): its gaps to `ref` and, per target, `FIXED` or why it was not (the caller swaps the start
    in)."""
    step = ImpactPass(model, ref, options, device, gaps or ReferenceGaps(ref, model), targets, loss_scale,
                      perturb=perturb, optimizers=optimizers, expected=expected)
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


def perturbation(run_dtype: str, ref_meta: dict, modes: dict) -> float:
    """The perturbed run's unit roundoff: of the coarser of the two runs' precisions, their reduced float32 modes
    (TF32: `runtime/precision_modes.py`) counted, as the multi-step twin's."""
    theirs = amp_dtype_name(ref_meta.get("amp")) or str(ref_meta.get("dtype") or "float32")
    ref_modes = precision_modes.from_attr(ref_meta.get(PRECISION_MODES))
    return max(unit_roundoff(run_dtype), unit_roundoff(theirs), precision_modes.roundoff(modes),
               precision_modes.roundoff(ref_modes))


def _once(job: Impact, targets: list[Candidate], perturb: float = 0.0) -> tuple[Gaps, dict]:
    """One run from the start, the `targets` fixed (each checked against its own error: `fixed_call.Fixes`)."""
    expected = {(c.module, c.call): (c.phase, c.tensor, c.rel_l2) for c in targets}
    with job.start.swapped_in():
        return job.once([(c.module, c.call) for c in targets], perturb=perturb, expected=expected)


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
    runs = len(candidates) + 2 + (len(candidates) > 1)
    _say(job, f"impact 1/{runs}: nothing fixed")
    plain, _ = _once(job, [])
    check = _check(plain.loss, job.recorded_loss)
    attrs.update(check=check, reference_loss=plain.reference_loss)
    if check and job.device_type == "cpu":
        why = (f"not measured: the iteration run again from its start gives loss {plain.loss!r}, the recorded one "
               f"{job.recorded_loss!r} (the iteration function has side effects of its own?)")
        return [_row(PLAIN, plain, note=why)], {**attrs, "seconds": time.perf_counter() - began}
    rows = [_row(PLAIN, plain)]
    _say(job, f"impact 2/{runs}: nothing fixed, the weights perturbed by one rounding")
    perturbed, _ = _once(job, [], perturb=job.roundoff)
    rows.append(_row(PERTURBED, perturbed, note=f"weights x (1 +- {2 * job.roundoff:.1e}) until the step"))
    for number, candidate in enumerate(candidates, start=3):
        _say(job, f"impact {number}/{runs}: {candidate.name} fixed")
        fixed, done = _once(job, [candidate])
        rows.append(_row(CALL, fixed, candidate, _note(done, (candidate.module, candidate.call))))
    if len(candidates) > 1:
        _say(job, f"impact {runs}/{runs}: all {len(candidates)} fixed")
        keys = [(c.module, c.call) for c in candidates]
        every, done = _once(job, candidates)
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
