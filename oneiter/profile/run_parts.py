"""What both drivers of a profiling run share: `runner.profile()` (`oneiter profile`'s own loop) and
`session.ProfileSession` (which the runner and the mmengine hook drive step by step).

Here live the run's pieces that need no session: the summary head and the option warnings, the profiler's
activities for a device, the device sync around each timed step, the allocator's memory history (both from the
device table, `runtime/devices.py`), and the one trace handler `CycleExporter`. Keeping them out of `runner.py`
lets the session use them without importing the runner, which imports the session: the profile package's imports
go one way (run_parts -> session -> runner). `options` is the run's `runner.ProfileOptions` throughout (not imported
here, for that reason).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from oneiter.outputs import file_in
from oneiter.profile.schedule import ProfileSchedule
from oneiter.profile.summary import FORMAT, write_summary
from oneiter.profile.tables import build_tables, format_memory, format_modules, format_ops
from oneiter.profile.trace import TRACE_SUFFIX, trace_stem, write_trace
from oneiter.runtime.devices import (
    PRIVATEUSE1_SINCE,
    device_name,
    device_type,
    memory_history_api,
    profiler_activity,
)

__all__ = ["LARGE_TRACE_BYTES", "CycleExporter", "summary_head", "option_warnings", "activities", "memory_history",
           "sync"]

LARGE_TRACE_BYTES = 100 * 2**20  # JSON size above which chrome://tracing gets sluggish
# Uncompressed trace bytes per module per recorded step, measured on ResNet-18 (CPU, torch 2.13: 1.1 MB of JSON
# for 2 steps x 68 modules), and what each opt-in adds to it (with_flops records shapes too): an estimate that is
# good enough to warn before a run.
_BYTES_PER_MODULE_STEP = 8_000
_SIZE_EXTRA = {"record_shapes": 0.6, "profile_memory": 0.9, "with_stack": 5.4}


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def summary_head(options, sched: ProfileSchedule, device) -> dict[str, Any]:
    import torch

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
        "warnings": _device_warnings(device), "files": [],
    }  # fmt: skip


def _device_notes(device, profile_memory: bool) -> list[str]:
    if device.type == "cpu":
        return [f"device '{device}' has no CUDA: CUDA activity, CUDA memory and the memory-history snapshot "
                f"are skipped"]
    kind = device.type.upper()
    if memory_history_api(device.type) is None:
        return [f"device '{device}' keeps no allocator history oneiter can read: no memory-history snapshot"]
    if profile_memory:
        return [f"{kind} memory history is recorded: open <trace>.memory_snapshot.pickle at "
                f"https://pytorch.org/memory_viz"]
    return [f"{kind} memory and the memory-history snapshot are recorded with --profile-memory only"]


def _device_warnings(device) -> list[str]:
    """Said once, as a warning, when the profiler can only see the CPU side of an accelerator's run."""
    if device.type == "cpu" or profiler_activity(device.type) is not None:
        return []
    import torch

    name = device_type(device.type).activity
    if name is None:
        why = f"oneiter knows no profiler activity for device type '{device.type}'"
    else:
        since = f", which torch >= {PRIVATEUSE1_SINCE} has" if name == "PrivateUse1" else ""
        why = f"this torch {torch.__version__} has no ProfilerActivity.{name}{since}"
    return [f"device '{device}': torch.profiler records the CPU side only ({why}); "
            "use the vendor's profiler for device activity"]


def option_warnings(options, sched: ProfileSchedule, num_modules: int) -> list[str]:
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
    """The CPU's activity and the device's own from the device table (CUDA, XPU, PrivateUse1 for plugins); the
    summary warns when the device has none in this torch (`_device_warnings`)."""
    from torch.profiler import ProfilerActivity

    own = profiler_activity(device.type)
    return [ProfilerActivity.CPU] + ([own] if own is not None else [])


def sync(device) -> None:
    if device.type != "cpu":
        import torch

        sync = getattr(getattr(torch, device.type, None), "synchronize", None)
        if sync is not None:
            sync()


@contextlib.contextmanager
def memory_history(device, enabled: bool):
    """Record the device allocator's history (for the snapshot) while profiling, where the device table says
    the device keeps one (CUDA, and the plugins mirroring its API); a no-op elsewhere."""
    memory = memory_history_api(device.type) if enabled else None
    if memory is None:
        yield
        return
    memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        memory._record_memory_history(enabled=None)


class CycleExporter:
    """The trace handler: torch.profiler calls it once per active cycle; every export happens here, once."""

    def __init__(self, options, sched: ProfileSchedule, out_dir: Path, summary: dict, module_info):
        self.options, self.sched, self.out_dir = options, sched, out_dir
        self.summary, self.module_info = summary, module_info

    def __call__(self, prof) -> None:
        cycle = len(self.summary["cycles"])
        steps = self.sched.active_steps(cycle)
        opts = self.options
        stem = trace_stem(opts.model, self.summary["device"], self.summary["rank"], steps, opts.dtype, opts.amp)
        entry: dict[str, Any] = {"cycle": cycle, "steps": steps}
        entry.update(write_trace(prof, file_in(self.out_dir, stem + TRACE_SUFFIX, "--out")))
        self.summary["files"].append(entry["trace"])
        memory_sort = opts.memory_sort if opts.profile_memory else None
        entry.update(build_tables(prof, len(steps), self.module_info, by_shape=opts.record_shapes,
                                  memory_sort=memory_sort))
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
        file_in(self.out_dir, entry["tables"], "--out").write_text(self._tables_text(entry), encoding="utf-8")
        self.summary["files"].append(entry["tables"])
        self.summary["cycles"].append(entry)
        write_summary(self.out_dir, self.summary)

    def _snapshot(self, stem: str) -> str | None:
        memory = memory_history_api(self.summary["device"].split(":", 1)[0]) if self.options.profile_memory else None
        if memory is None:
            return None
        name = stem + ".memory_snapshot.pickle"
        memory._dump_snapshot(str(file_in(self.out_dir, name, "--out")))
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
