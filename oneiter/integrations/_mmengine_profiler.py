"""`OneIterProfilerHook`: profile a Runner's training iterations with the exports of `oneiter profile`.

Where it sits: the mmengine counterpart of `profile/runner.py`, imported (and so registered) by
`oneiter.integrations.mmengine`. Like the Trainer and Lightning `ProfileCallback`s it forwards the runner's events
to a `profile.stepped.StepProfiler`, which drives one `profile.profile_session.ProfileSession` (profiler, clock,
overhead), so it reuses that library whole: the schedule (`profile/schedule.py`), the one trace handler
(`steps.CycleExporter`: per active cycle one `export_chrome_trace`, the op/memory/module tables and `summary.json`), the
per-module ranges and the Kineto log filter. mmengine's own ProfilerHook exports a trace twice when both a TensorBoard
trace and `json_trace_path` are configured, and torch refuses the second export ("RuntimeError: Trace is already
saved"); here the handler writes one gzipped Chrome trace, which TensorBoard's profiler plugin, Perfetto and
chrome://tracing all open.

Steps: schedule step 0 is the first training iteration of this run (`first_iter` in summary.json; nonzero after
a resume); the profiler starts in `before_train`, steps after every iteration and stops as soon as the schedule is
done, so the rest of training runs unprofiled. The next iterations (as many as were recorded, at least 5) are
timed without the profiler, for the overhead (`overhead` in summary.json: ratio of medians, spreads, or "machine
too noisy to tell") that `oneiter profile` reports.

Limits: mmengine calls no hook when training raises, so after an exception the profiler and the module ranges
(observation only: they never change a value) stay on the model of that failed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from oneiter.profile.stepped import ProfileSettings, StepProfiler

__all__ = ["OneIterProfilerHook"]


@HOOKS.register_module()
class OneIterProfilerHook(Hook):
    """Profile the training iterations a schedule selects; write what `oneiter profile` writes to `out_dir`.

    Args: keywords only, the fields of `profile.stepped.ProfileSettings` (declared and checked there):
        schedule: torch.profiler's vocabulary, as a string `'wait=1,warmup=1,active=2'` or a dict; keys not given
            default to wait=0, warmup=1, active=1, repeat=1, skip_first=0. One trace per cycle (`repeat`).
        out_dir: the profile directory (default `<work_dir>/oneiter_profile`): traces
            `<model>_<device>_rank<R>_steps<a>-<b>.pt.trace.json.gz`, `<trace>.tables.txt`, `summary.json`.
        record_shapes / profile_memory / with_stack / with_flops: torch.profiler's options.
        memory_sort: the memory table's sort column, one of `profile.tables.MEMORY_SORTS`.
        module_ranges: forward/backward ranges per module path (the module table needs them).
        model_name: the name in file names and summary.json (default: the model's class name).
        force: replace a previous oneiter profile in `out_dir`.
    """

    priority = "VERY_LOW"

    def __init__(self, **settings: Any):
        self.settings = ProfileSettings.given(type(self).__name__, settings)  # its fields: the keywords
        self.schedule, self.out_dir = self.settings.profile_schedule, self.settings.profile_dir
        self.profiler: Optional[StepProfiler] = None  # from before_train on

    __init__.__signature__ = ProfileSettings.keywords_signature()  # type: ignore[attr-defined]  # for help()

    @property
    def summary(self) -> Optional[dict[str, Any]]:
        """summary.json's content once profiling started."""
        return self.profiler.summary if self.profiler is not None else None

    # -- runner callbacks -------------------------------------------------------------------------------------------
    def before_train(self, runner) -> None:
        self.settings.check_fits(runner.max_iters - runner.iter)
        model = _unwrap(runner.model)
        self.out_dir = self.out_dir or Path(runner.work_dir) / "oneiter_profile"
        optim = getattr(runner.optim_wrapper, "optimizer", None)
        amp = getattr(runner.optim_wrapper, "cast_dtype", None)
        loader = getattr(runner, "train_dataloader", None)
        options = self.settings.options(
            model, out_dir=self.out_dir, batch_size=int(getattr(loader, "batch_size", 0) or 0), seed=runner.seed,
            amp=str(amp).removeprefix("torch.") if amp is not None else None,
            optimizer=type(optim).__name__.lower() if optim is not None else "")
        self.profiler = StepProfiler(model, options, self.schedule,
                                     extra={"first_iter": runner.iter, "framework": "mmengine"},
                                     log=lambda level, text: getattr(runner.logger, level)(text))
        self.profiler.start()

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.profiler is not None:
            self.profiler.begin_step()

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self.profiler is not None:
            self.profiler.end_step()

    def after_train(self, runner) -> None:
        if self.profiler is not None:
            self.profiler.end_run()

    def after_run(self, runner) -> None:
        if self.profiler is not None and self.profiler.session is not None and self.profiler.session.profiling:
            self.profiler.end_run()


def _unwrap(model):
    from mmengine.model import is_model_wrapper

    return model.module if is_model_wrapper(model) else model
