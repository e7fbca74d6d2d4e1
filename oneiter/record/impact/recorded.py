"""`impact=True` at the end of a Recorder's block: the runs of `runs.py` over the iteration just recorded, their
`/impact` table into its file.

Where this sits: `oneiter.Recorder` calls `measure_block` once its iteration is over and its calls are judged, before
the file is closed, with the iteration it was given (`rec.run(fn)`) as `run_again(step)`: one more run of it, `step`
(an `ImpactPass`) handing out its batch and taking its loss.
"""

from __future__ import annotations

from typing import Callable

from oneiter.record.impact.gaps import ReferenceGaps
from oneiter.record.impact.runs import Impact, measure, one_pass, perturbation
from oneiter.runtime.precision import amp_dtype_name

__all__ = ["measure_block"]


def measure_block(model, ref, options, device, optimizers: list, *, loss: float, session, start, modes, dtype,
                  progress: Callable[[str, int], None] | None, run_again: Callable) -> dict:
    """The impact runs of one recorded iteration, written as the file's `/impact` table; returns their count and
    seconds. `start`: the iteration's start (`start.py`); `modes`: the precision modes in force; `dtype`: the
    model's floating-point parameters' (None: none)."""
    capture = session.module_capture
    scale = capture.grad_scale  # a loss `rec.loss` named is taken as it is (`ReferencePass.loss_tensor`)
    gaps = ReferenceGaps(ref, model)
    run_dtype = amp_dtype_name(options.amp) or str(dtype or "float32").replace("torch.", "")
    job = Impact(start,
                 lambda targets, **how: one_pass(model, ref, options, device, targets, run_again, scale, gaps,
                                                 optimizers=optimizers, **how),
                 loss, device.type,
                 (lambda text: progress(text, session.sink.num_tensors)) if progress else None,
                 roundoff=perturbation(run_dtype, ref.meta, modes))
    session.enter_phase("impact")
    with capture.suspended():
        rows, attrs = measure(job, session.probe.rows if session.probe else [], run_dtype, options.impact_top)
    session.writer.impact_table(rows, attrs)
    return {"runs": len(rows), "seconds": float(attrs.get("seconds", 0.0))}

