"""`OneIterProfilerHook`: profile a Runner's training iterations with the exports of `oneiter profile`.

Where it sits: the mmengine counterpart of `profile/runner.py`, imported (and so registered) by
`oneiter.integrations.mmengine`. Both drive one `profile.session.ProfileSession` (profiler, clock, overhead), so it
reuses that library whole: the schedule (`profile/schedule.py`), the one trace handler (`steps.CycleExporter`:
per active cycle one `export_chrome_trace`, the op/memory/module tables and `summary.json`), the per-module
ranges and the Kineto log filter. mmengine's own ProfilerHook exports a trace twice when both a TensorBoard
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

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from oneiter.errors import OneIterError
from oneiter.profile.runner import ProfileOptions
from oneiter.profile.schedule import DEFAULT_SCHEDULE, ProfileSchedule, parse_schedule
from oneiter.profile.session import ProfileSession
from oneiter.profile.summary import prepare_out_dir, write_summary
from oneiter.profile.tables import MEMORY_SORTS

__all__ = ["OneIterProfilerHook"]

_FLAGS = ("record_shapes", "profile_memory", "with_stack", "with_flops", "module_ranges", "force")


def _parse(schedule: Union[str, Mapping[str, int], ProfileSchedule]) -> ProfileSchedule:
    try:
        if isinstance(schedule, ProfileSchedule):
            return schedule
        if isinstance(schedule, str):
            return parse_schedule(schedule)
        if isinstance(schedule, Mapping):
            return ProfileSchedule(**schedule)
    except (OneIterError, TypeError) as err:
        raise ValueError(f"schedule should be like '{DEFAULT_SCHEDULE}' or dict(wait=1, warmup=1, active=2), "
                         f"but got {schedule!r}: {err}") from None
    raise TypeError(f"schedule should be a str or a dict, but got {schedule!r}")


@HOOKS.register_module()
class OneIterProfilerHook(Hook):
    """Profile the training iterations a schedule selects; write what `oneiter profile` writes to `out_dir`.

    Args:
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

    def __init__(
        self,
        *,
        schedule: Union[str, Mapping[str, int]] = DEFAULT_SCHEDULE,
        out_dir: Optional[Union[str, os.PathLike]] = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        memory_sort: str = "self_cpu_memory",
        module_ranges: bool = True,
        model_name: Optional[str] = None,
        force: bool = False,
    ):
        self.schedule = _parse(schedule)
        flags = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                     with_flops=with_flops, module_ranges=module_ranges, force=force)  # fmt: skip
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name} should be a bool, but got {value!r}")
        if memory_sort not in MEMORY_SORTS:
            raise ValueError(f"memory_sort should be one of {', '.join(MEMORY_SORTS)}, but got {memory_sort!r}")
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir should be a directory path or None, but got {out_dir!r}")
        if model_name is not None and not isinstance(model_name, str):
            raise TypeError(f"model_name should be a str or None, but got {model_name!r}")
        self.flags = flags
        self.memory_sort = memory_sort
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.model_name = model_name
        self.summary: Optional[dict[str, Any]] = None  # summary.json's content once profiling started
        self.session = None  # the ProfileSession, from before_train on
        self._device = None
        self._timing_unprofiled = False  # after the profiler stopped: timing plain steps for the overhead

    # -- runner callbacks -------------------------------------------------------------------------------------------
    def before_train(self, runner) -> None:

        remaining = runner.max_iters - runner.iter
        if self.schedule.num_steps > remaining:
            raise ValueError(
                f"schedule should fit in the training run, but {self.schedule} needs {self.schedule.num_steps} "
                f"iterations and only {remaining} remain: its active window would never be reached"
            )
        model = _unwrap(runner.model)
        options = self._options(runner, model)
        out_dir = prepare_out_dir(Path(options.out_dir), options.force)
        self.session = ProfileSession(model, options, self.schedule, self._device, out_dir,
                                      extra={"first_iter": runner.iter, "framework": "mmengine"})
        self.summary = self.session.summary
        self.session.start()

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.session is not None and (self.session.profiling or self._timing_unprofiled):
            self.session.begin_step()

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        session = self.session
        if session is None:
            return
        if session.profiling:
            session.end_step()
            if session.done:
                self._stop(runner)
        elif self._timing_unprofiled:
            session.end_unprofiled_step()
            if len(session.unprofiled) >= session.unprofiled_wanted:
                self._timing_unprofiled = False
                session.finish()

    def after_train(self, runner) -> None:
        session = self.session
        if session is not None and session.profiling:
            session.summary["warnings"].append(
                f"training ended after {session.step} of the schedule's {self.schedule.num_steps} steps: "
                "cycles not finished have no trace"
            )
            self._stop(runner)
        if session is not None and self._timing_unprofiled:
            session.summary["notes"].append(
                f"training ended after {len(session.unprofiled)} of {session.unprofiled_wanted} unprofiled steps: "
                "the overhead rests on those")
            self._timing_unprofiled = False
            session.finish()

    def after_run(self, runner) -> None:
        if self.session is not None and self.session.profiling:
            self._stop(runner)

    # -- profiler lifetime ------------------------------------------------------------------------------------------
    def _options(self, runner, model) -> ProfileOptions:
        """What `oneiter profile` would have been given, read off the runner (names the trace and the summary)."""
        param = next(model.parameters(), None)
        import torch

        self._device = param.device if param is not None else torch.device("cpu")
        self.out_dir = self.out_dir or Path(runner.work_dir) / "oneiter_profile"
        optim = getattr(runner.optim_wrapper, "optimizer", None)
        amp = getattr(runner.optim_wrapper, "cast_dtype", None)
        loader = getattr(runner, "train_dataloader", None)
        return ProfileOptions(
            model=self.model_name or type(model).__name__, device=str(self._device),
            batch_size=int(getattr(loader, "batch_size", 0) or 0), seed=int(runner.seed),
            dtype=str(param.dtype).removeprefix("torch.") if param is not None else "float32",
            amp=str(amp).removeprefix("torch.") if amp is not None else None,
            optimizer=type(optim).__name__.lower() if optim is not None else "",
            schedule=str(self.schedule), out_dir=self.out_dir, memory_sort=self.memory_sort,
            measure_overhead=True, **self.flags,
        )  # fmt: skip

    def _stop(self, runner) -> None:
        session = self.session
        session.stop()
        self._timing_unprofiled = session.unprofiled_wanted > 0
        write_summary(session.out_dir, session.summary)  # the traces are complete; the overhead comes later
        traces = [c["trace"] for c in session.summary["cycles"]]
        runner.logger.info(f"oneiter: profiled {len(traces)} cycle(s) into {session.out_dir}: {', '.join(traces)}")
        for warning in session.summary["warnings"]:
            runner.logger.warning(f"oneiter profile: {warning}")


def _unwrap(model):
    from mmengine.model import is_model_wrapper

    return model.module if is_model_wrapper(model) else model
