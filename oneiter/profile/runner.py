"""`profile(options) -> ProfileResult`: run exactly the training iterations a schedule needs under torch.profiler.

Where it sits: `oneiter profile` and the tests call `profile()`. It builds the model like every oneiter command
(`load_model` -> `apply_dtype` -> `prepare` -> `train_step`), asks `schedule.py` how many steps to run, installs the
module ranges of `module_ranges.py`, and gives torch.profiler one trace handler, `CycleExporter`, which once per
active cycle writes the trace (`trace.py`), the tables (`tables.py`) and `summary.json` (`summary.py`). Then it
times as many unprofiled iterations as were recorded and stores the profiled/unprofiled ratio.

Kineto's native log lines are filtered out around every profiler call (`quiet.py`); Python warnings raised while
profiling are collected into the summary instead of interleaving with the progress display.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oneiter.errors import OneIterError
from oneiter.profile.quiet import native_output_filtered, quiet_kineto_env
from oneiter.profile.schedule import DEFAULT_MAX_STEPS, DEFAULT_SCHEDULE, ProfileSchedule, parse_schedule
from oneiter.profile.summary import FORMAT, SUMMARY_NAME, check_out_dir, prepare_out_dir, write_summary
from oneiter.profile.tables import MEMORY_SORTS, build_tables, format_memory, format_modules, format_ops
from oneiter.profile.trace import TRACE_SUFFIX, trace_stem, write_trace

__all__ = [
    "ProfileOptions", "ProfileResult", "profile", "LARGE_TRACE_BYTES", "CycleExporter", "summary_head",
    "option_warnings", "activities", "memory_history", "sync",
]

LARGE_TRACE_BYTES = 100 * 2**20  # JSON size above which chrome://tracing gets sluggish
# Uncompressed trace bytes per module per recorded step, measured on ResNet-18 (CPU, torch 2.13: 1.1 MB of JSON
# for 2 steps x 68 modules), and what each opt-in adds to it (with_flops records shapes too): an estimate that is
# good enough to warn before a run.
_BYTES_PER_MODULE_STEP = 8_000
_SIZE_EXTRA = {"record_shapes": 0.6, "profile_memory": 0.9, "with_stack": 5.4}


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
    from oneiter.profile.session import ProfileSession

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
    from oneiter.runtime.devices import resolve_device
    from oneiter.runtime.modelspec import load_model
    from oneiter.runtime.precision import apply_dtype, autocast_for
    from oneiter.runtime.training import prepare, set_threads

    set_threads(options.threads)
    device = resolve_device(options.device)
    autocast_for(device, options.amp)  # validates --amp before the model is built
    bundle = load_model(options.model, options.batch_size, options.seed, options.model_args)
    apply_dtype(bundle, options.dtype)
    return prepare(bundle, device, options.optimizer), device


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def summary_head(options: ProfileOptions, sched: ProfileSchedule, device) -> dict[str, Any]:
    import torch

    from oneiter.runtime.devices import device_name

    return {
        "format": FORMAT,
        "model": options.model, "model_args": options.model_args, "device": str(device),
        "device_name": device_name(device), "dtype": options.dtype, "amp": options.amp,
        "batch_size": options.batch_size, "seed": options.seed, "optimizer": options.optimizer,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "rank": _rank(),
        "schedule": str(sched), "num_steps": sched.num_steps,
        "options": {k: getattr(options, k) for k in
                    ("record_shapes", "profile_memory", "with_stack", "with_flops", "memory_sort", "module_ranges")},
        "cycles": [], "overhead": None, "notes": _device_notes(device, options.profile_memory),
        "warnings": [], "files": [],
    }  # fmt: skip


def _device_notes(device, profile_memory: bool) -> list[str]:
    if device.type == "cuda":
        if profile_memory:
            return ["CUDA memory history is recorded: open <trace>.memory_snapshot.pickle at https://pytorch.org/memory_viz"]
        return ["CUDA memory and the memory-history snapshot are recorded with --profile-memory only"]
    if device.type == "cpu":
        return [f"device '{device}' has no CUDA: CUDA activity, CUDA memory and the memory-history snapshot are skipped"]
    return [f"device '{device}': torch.profiler records the CPU side only; use the vendor's profiler for device activity"]


def option_warnings(options: ProfileOptions, sched: ProfileSchedule, num_modules: int) -> list[str]:
    out = []
    if sched.warmup == 0:
        out.append("warmup=0: the first recorded step pays the profiler's start-up cost; warmup=1 avoids that")
    if options.with_stack:
        out.append("--with-stack: Python frames make traces several times larger (the op table leaves them out)")
    enabled = {"record_shapes": options.record_shapes or options.with_flops,
               "profile_memory": options.profile_memory, "with_stack": options.with_stack}  # fmt: skip
    factor = 1 + sum(extra for name, extra in _SIZE_EXTRA.items() if enabled[name])
    estimate = sched.active * num_modules * _BYTES_PER_MODULE_STEP * factor
    if estimate > LARGE_TRACE_BYTES:
        out.append(
            f"large trace ahead: about {estimate / 2**20:.0f} MB of JSON per cycle ({sched.active} active steps x "
            f"{num_modules} modules); chrome://tracing gets slow above {LARGE_TRACE_BYTES // 2**20} MB, "
            "fewer active steps or opt-ins keep it small"
        )
    return out


def activities(device) -> list:
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    elif device.type == "xpu" and hasattr(ProfilerActivity, "XPU"):
        activities.append(ProfilerActivity.XPU)
    return activities


def sync(device) -> None:
    if device.type != "cpu":
        import torch

        sync = getattr(getattr(torch, device.type, None), "synchronize", None)
        if sync is not None:
            sync()


def _step(setup, device, amp: str | None) -> None:
    from oneiter.runtime.precision import autocast_for
    from oneiter.runtime.training import train_step

    train_step(setup, autocast=autocast_for(device, amp))


@contextlib.contextmanager
def memory_history(device, enabled: bool):
    """Record CUDA allocator history (for the snapshot) while profiling; a no-op elsewhere."""
    if not (enabled and device.type == "cuda"):
        yield
        return
    import torch

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


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


class CycleExporter:
    """The trace handler: torch.profiler calls it once per active cycle; every export happens here, once."""

    def __init__(self, options: ProfileOptions, sched: ProfileSchedule, out_dir: Path, summary: dict, module_info):
        self.options, self.sched, self.out_dir = options, sched, out_dir
        self.summary, self.module_info = summary, module_info

    def __call__(self, prof) -> None:
        cycle = len(self.summary["cycles"])
        steps = self.sched.active_steps(cycle)
        opts = self.options
        stem = trace_stem(opts.model, self.summary["device"], self.summary["rank"], steps, opts.dtype, opts.amp)
        entry: dict[str, Any] = {"cycle": cycle, "steps": steps}
        entry.update(write_trace(prof, self.out_dir / (stem + TRACE_SUFFIX)))
        self.summary["files"].append(entry["trace"])
        memory_sort = opts.memory_sort if opts.profile_memory else None
        entry.update(build_tables(prof, len(steps), self.module_info, by_shape=opts.record_shapes, memory_sort=memory_sort))
        if entry["profiler_steps"] != steps:
            self.summary["warnings"].append(
                f"cycle {cycle}: the trace holds ProfilerStep {entry['profiler_steps']}, expected {steps}"
            )
        if entry["trace_json_bytes"] > LARGE_TRACE_BYTES:
            self.summary["warnings"].append(
                f"{entry['trace']} is large: {entry['trace_json_bytes'] / 2**20:.0f} MB of JSON "
                f"({entry['trace_bytes'] / 2**20:.1f} MB gzipped)"
            )
        entry["memory_snapshot"] = self._snapshot(stem)
        entry["tables"] = stem + ".tables.txt"
        (self.out_dir / entry["tables"]).write_text(self._tables_text(entry), encoding="utf-8")
        self.summary["files"].append(entry["tables"])
        self.summary["cycles"].append(entry)
        write_summary(self.out_dir, self.summary)

    def _snapshot(self, stem: str) -> str | None:
        if not (self.options.profile_memory and self.summary["device"].startswith("cuda")):
            return None
        import torch

        name = stem + ".memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(self.out_dir / name))
        self.summary["files"].append(name)
        return name

    def _tables_text(self, entry: dict[str, Any]) -> str:
        s = self.summary
        device = s["device"] != "cpu"
        parts = [
            f"oneiter profile: {s['model']} on {s['device']} ({s['device_name']}), {s['dtype']}"
            f"{', amp ' + s['amp'] if s['amp'] else ''}, batch {s['batch_size']}, steps {entry['steps']}\n",
            "== ops ==\n" + format_ops(entry["ops"], device=device),
        ]
        if self.options.profile_memory:
            parts.append("== memory ==\n" + format_memory(entry["memory"], self.options.memory_sort, device=device))
        if entry["modules"]:
            parts.append("== modules ==\n" + format_modules(entry["modules"]))
        return "\n".join(parts)
