"""`ProfileSession`: one profiling run over a model's training iterations, driven step by step.

Both callers drive the same object: `runner.profile()` (what `oneiter profile` runs: its own loop over
`train_step`) and the mmengine `OneIterProfilerHook` (mmengine's loop; the hook's callbacks call `begin_step` /
`end_step`). The session owns what the two used to write twice: the summary head and option warnings, the
torch.profiler object and its trace handler (`steps.CycleExporter`), module ranges, CUDA memory history, the
warning about backward calls that never finished, and the overhead measurement (`overhead()`).

    session = ProfileSession(model, options, schedule, device, out_dir)
    session.start()
    while not session.done:
        session.begin_step(); train_one_step(); session.end_step()
    session.stop()
    ... unprofiled steps: session.begin_step(); train_one_step(); session.end_unprofiled_step()
    session.finish()   # overhead into the summary, summary.json written
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from oneiter.profile.module_ranges import ModuleRanges
from oneiter.profile.quiet import native_output_filtered, quiet_kineto_env
from oneiter.profile.run_parts import CycleExporter, activities, memory_history, option_warnings, summary_head, sync
from oneiter.profile.schedule import ProfileSchedule
from oneiter.profile.summary import write_summary

if TYPE_CHECKING:
    import torch.profiler

__all__ = ["ProfileSession", "overhead", "UNPROFILED_STEPS", "NOISY_SPREAD"]

UNPROFILED_STEPS = 5  # at least this many unprofiled steps are timed against the profiled ones
NOISY_SPREAD = 0.25  # unprofiled steps whose (max - min) / median exceeds this cannot support a ratio
UNFINISHED = ("{n} module backward call(s) had autograd nodes that never ran (outputs not reaching the loss); "
              "their backward time runs to the end of the backward pass")


class ProfileSession:
    """The profiler, the exporter and the step clock of one profiling run (see the module docstring)."""

    def __init__(self, model, options, schedule: ProfileSchedule, device, out_dir: Path,
                 extra: Optional[dict[str, Any]] = None):
        quiet_kineto_env()
        self.model, self.options, self.schedule, self.device, self.out_dir = model, options, schedule, device, out_dir
        module_info = {p: (type(m).__name__, not any(True for _ in m.children())) for p, m in model.named_modules()}
        self.summary = summary_head(options, schedule, device)
        self.summary.update(extra or {})
        self.summary["warnings"] += option_warnings(options, schedule, len(module_info))
        self.exporter = CycleExporter(options, schedule, out_dir, self.summary,
                                      module_info if options.module_ranges else {})  # fmt: skip
        self.step = 0  # profiler steps run so far
        self.active: list[float] = []  # wall time of each recorded (active) step
        self.unprofiled: list[float] = []  # wall time of each unprofiled step after the profiler stopped
        self._prof: Optional[torch.profiler.profile] = None
        self._ranges: Optional[ModuleRanges] = None
        self._stack = contextlib.ExitStack()
        self._started = 0.0

    @property
    def profiling(self) -> bool:
        return self._prof is not None

    @property
    def done(self) -> bool:
        """Every step the schedule needs has run."""
        return self.step >= self.schedule.num_steps

    @property
    def unprofiled_wanted(self) -> int:
        """How many unprofiled steps to time: as many as were recorded, and at least UNPROFILED_STEPS."""
        return max(len(self.active), UNPROFILED_STEPS) if self.active and self.options.measure_overhead else 0

    def start(self) -> None:
        import torch.profiler

        o = self.options
        prof = self._prof = torch.profiler.profile(
            activities=activities(self.device), schedule=self.schedule.torch_schedule(), on_trace_ready=self.exporter,
            record_shapes=o.record_shapes, profile_memory=o.profile_memory, with_stack=o.with_stack,
            with_flops=o.with_flops,
        )
        if o.module_ranges:
            self._ranges = self._stack.enter_context(ModuleRanges(self.model))
        self._stack.enter_context(memory_history(self.device, o.profile_memory))
        with native_output_filtered():
            prof.start()

    def begin_step(self) -> None:
        sync(self.device)
        self._started = time.perf_counter()

    def end_step(self) -> float:
        """After a profiled step: its time is kept if the step was recorded, then the profiler steps (the trace
        handler runs in here after the last step of each active window). Returns the step's seconds."""
        sync(self.device)
        seconds = time.perf_counter() - self._started
        if self.schedule.phase(self.step) == "active":
            self.active.append(seconds)
        assert self._prof is not None  # a profiled step follows start()
        with native_output_filtered():
            self._prof.step()
        self.step += 1
        return seconds

    def end_unprofiled_step(self) -> float:
        sync(self.device)
        seconds = time.perf_counter() - self._started
        self.unprofiled.append(seconds)
        return seconds

    def stop(self, *, failed: bool = False) -> None:
        """Stop the profiler (after an error, without hiding it behind one from stopping the profiler)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            with native_output_filtered(), contextlib.ExitStack() as guard:
                if failed:
                    guard.enter_context(contextlib.suppress(Exception))
                prof.stop()
        finally:
            self._stack.close()
        if self._ranges is not None and self._ranges.num_unfinished:
            self.summary["warnings"].append(UNFINISHED.format(n=self._ranges.num_unfinished))

    def finish(self) -> dict[str, Any]:
        """The overhead (when unprofiled steps were timed) into the summary; summary.json written."""
        if self.options.measure_overhead and self.active:
            self.summary["overhead"] = overhead(self.active, self.unprofiled)
        write_summary(self.out_dir, self.summary)
        return self.summary


def overhead(profiled: list[float], unprofiled: list[float]) -> Optional[dict[str, Any]]:
    """Profiled against unprofiled step time, from matched steps (the same training iteration, warm).

    The figure is the ratio of the medians, with each side's spread ((max - min) / median). When the unprofiled
    steps alone vary by more than NOISY_SPREAD, or there are too few steps, the machine's noise is as
    large as what is measured: `ratio` is None and `verdict` says why, instead of a number that changes from run to
    run (a minimum of two steps once gave 0.07x and 4.63x for the same model). It needs 2 profiled and 3
    unprofiled steps at least.
    """
    if not profiled:
        return None
    if not unprofiled:
        return {"num_profiled": len(profiled), "num_unprofiled": 0, "ratio": None,
                "verdict": "no unprofiled steps ran: no overhead measurement"}
    med_p, med_u = statistics.median(profiled), statistics.median(unprofiled)
    spread_p = (max(profiled) - min(profiled)) / med_p if med_p > 0 else 0.0
    spread_u = (max(unprofiled) - min(unprofiled)) / med_u if med_u > 0 else 0.0
    ratio = med_p / med_u if med_u > 0 else None
    result: dict[str, Any] = {
        "num_profiled": len(profiled), "num_unprofiled": len(unprofiled),
        "profiled_median_s": round(med_p, 6), "unprofiled_median_s": round(med_u, 6),
        "profiled_spread": round(spread_p, 4), "unprofiled_spread": round(spread_u, 4),
        "ratio": None if ratio is None else round(ratio, 4),
        "measured": "median recorded training step (trace export excluded) over the median of unprofiled steps of "
                    "the same iteration run right after; spread = (max - min) / median",
    }
    if ratio is None:  # a clock too coarse for the steps: no figure to format
        result["verdict"] = "unprofiled steps took no measurable time (median 0 s): no ratio"
    elif len(profiled) < 2 or len(unprofiled) < 3:
        result["verdict"] = (f"{ratio:.2f}x from {len(profiled)} profiled and {len(unprofiled)} unprofiled steps: too "
                             f"few to tell the machine's noise apart (give the schedule active=2 or more)")
        result["ratio"] = None
    elif spread_u > NOISY_SPREAD:
        result["verdict"] = (f"machine too noisy to tell: unprofiled steps vary by {spread_u:.0%} of their median "
                             f"(more than {NOISY_SPREAD:.0%}); the ratio of medians would be {ratio:.2f}x")
        result["ratio"] = None
    else:
        result["verdict"] = (f"{ratio:.2f}x (median {med_p * 1000:.1f} ms profiled over {med_u * 1000:.1f} ms "
                             f"unprofiled; spread {spread_p:.0%} / {spread_u:.0%}, {len(profiled)} and "
                             f"{len(unprofiled)} steps)")
        if ratio is not None and ratio < 1:
            result["verdict"] += (": below 1x is noise, not a speed-up (profiling adds work; what it costs here is "
                                  "smaller than how much one step's time varies from the next)")
    return result
