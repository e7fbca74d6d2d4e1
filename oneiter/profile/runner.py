"""`profile(options) -> ProfileResult`: run exactly the training iterations a schedule needs under torch.profiler.

Where it sits: `oneiter profile` and the tests call `profile()`. It builds the model like every oneiter command
(`load_model` -> `apply_dtype` -> `prepare` -> `train_step`), asks `schedule.py` how many steps to run, installs the
module ranges of `module_ranges.py`, and gives torch.profiler one trace handler, `steps.CycleExporter`, which once
per active cycle writes the trace (`trace.py`), the tables (`tables.py`) and `summary.json` (`summary.py`). Then it
times as many unprofiled iterations as were recorded and stores the profiled/unprofiled ratio.

Kineto's native log lines are filtered out around every profiler call (`quiet.py`); Python warnings raised while
profiling are collected into the summary instead of interleaving with the progress display.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oneiter.errors import OneIterError
from oneiter.profile.profile_session import ProfileSession
from oneiter.profile.quiet import native_output_filtered, quiet_kineto_env
from oneiter.profile.schedule import DEFAULT_MAX_STEPS, DEFAULT_SCHEDULE, parse_schedule
from oneiter.profile.summary import SUMMARY_NAME, check_out_dir, prepare_out_dir
from oneiter.profile.tables import MEMORY_SORTS
from oneiter.runtime.devices import resolve_device
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.precision import apply_dtype, autocast_for
from oneiter.runtime.training import prepare, set_threads, train_step

__all__ = ["ProfileOptions", "ProfileResult", "profile"]



@dataclass
class ProfileOptions:
    """Everything `oneiter profile` takes; the defaults are the CLI's."""

    model: str
    """Built-in model name or path/to/file.py:function."""
    device: str = "cpu"
    batch_size: int = 8
    seed: int = 0
    dtype: str = "float32"
    amp: str | None = None
    threads: int | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "sgd"
    schedule: str = DEFAULT_SCHEDULE
    """`wait=..,warmup=..,active=..,repeat=..,skip_first=..` (torch.profiler's names)."""
    out_dir: Path | str = "prof"
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    """Python stack frames in the trace (large, and many rows of `key_averages()` become Python frames)."""
    with_flops: bool = False
    memory_sort: str = "self_cpu_memory"
    """Column the memory table is sorted by: one of tables.MEMORY_SORTS."""
    module_ranges: bool = True
    """Place forward/backward ranges per module path (the module table needs them)."""
    measure_overhead: bool = True
    """Also time as many unprofiled iterations as were recorded."""
    max_steps: int = DEFAULT_MAX_STEPS
    """Refuse schedules needing more iterations than this."""
    force: bool = False
    """Replace a previous oneiter profile in `out_dir`."""

    def __post_init__(self) -> None:
        if self.memory_sort not in MEMORY_SORTS:
            raise OneIterError(f"--memory-sort must be one of {', '.join(MEMORY_SORTS)}, got '{self.memory_sort}'")
        if self.max_steps < 1:
            raise OneIterError(f"--max-steps must be at least 1, got {self.max_steps}")


@dataclass
class ProfileResult:
    """What a run left behind: the directory, and `summary` (the content of its summary.json)."""

    out_dir: Path
    summary: dict[str, Any]

    @property
    def summary_path(self) -> Path:
        return self.out_dir / SUMMARY_NAME

    @property
    def cycles(self) -> list[dict[str, Any]]:
        return self.summary["cycles"]

    @property
    def traces(self) -> list[Path]:
        return [self.out_dir / c["trace"] for c in self.cycles]

    @property
    def notes(self) -> list[str]:
        return self.summary["notes"]

    @property
    def warnings(self) -> list[str]:
        return self.summary["warnings"]

    @property
    def overhead(self) -> dict[str, Any] | None:
        return self.summary["overhead"]


StepCallback = Callable[[int, int, str], None]  # (step, num_steps, phase)


def profile(options: ProfileOptions, on_step: StepCallback | None = None) -> ProfileResult:
    """Profile `options.model`'s training iterations; write traces, tables and summary.json to `options.out_dir`."""
    sched = parse_schedule(options.schedule)
    sched.check_budget(options.max_steps)
    check_out_dir(Path(options.out_dir), options.force)  # before the (slow) model build; created only after it
    quiet_kineto_env()
    setup, device = _setup(options)
    out_dir = prepare_out_dir(Path(options.out_dir), options.force)
    session = ProfileSession(setup.bundle.model, options, sched, device, out_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _profiled_run(setup, options, session, on_step)
    for message in dict.fromkeys(str(w.message).strip() for w in caught):
        session.summary["warnings"].append(message)
    for _ in range(session.unprofiled_wanted):
        session.begin_step()
        _step(setup, device, options.amp)
        session.end_unprofiled_step()
    return ProfileResult(out_dir, session.finish())


def _setup(options: ProfileOptions):
    set_threads(options.threads)
    device = resolve_device(options.device)
    autocast_for(device, options.amp)  # validates --amp before the model is built
    bundle = load_model(options.model, options.batch_size, options.seed, options.model_args)
    apply_dtype(bundle, options.dtype)
    return prepare(bundle, device, options.optimizer), device


def _step(setup, device, amp: str | None) -> None:
    train_step(setup, autocast=autocast_for(device, amp))


def _profiled_run(setup, options, session, on_step) -> None:
    """Run the schedule's iterations under the session's profiler."""
    session.start()
    failed = True
    try:
        while not session.done:
            step = session.step
            with native_output_filtered():
                session.begin_step()
                _step(setup, session.device, options.amp)
                session.end_step()
            if on_step is not None:
                on_step(step, session.schedule.num_steps, session.schedule.phase(step))
        failed = False
    finally:
        session.stop(failed=failed)
