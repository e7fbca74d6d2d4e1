"""The op, memory and per-module tables of one profiling cycle, as JSON-ready rows and as fixed-width text.

Where it sits: the trace handler (`steps.CycleExporter`) calls `build_tables(prof, ...)` once per active cycle;
the rows go to `summary.json` and `<trace>.tables.txt`, `diff.py` aligns them across two profile directories.

Every number is **per step**: the cycle's total divided by its number of active steps. Times are microseconds,
memory is bytes (allocated minus freed, so it can be negative). Rows never hold addresses or timestamps.

- op table: one row per op name (and input shapes with `--record-shapes`), with self and total CPU time, device
  time where there is a device, calls; oneiter's module ranges, ProfilerStep and other annotations, and Python
  frames (`--with-stack`) are left out, so no row is counted twice.
- memory table (`--profile-memory`): op rows with nonzero memory, sorted by the chosen column.
- module table: one row per module path in `named_modules()` order, forward and backward time (and memory with
  `--profile-memory`) from the ranges of `module_ranges.py`; memory of a range is every allocation minus every
  free made during it, on any thread, the rule torch.profiler uses for its own ops.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from typing import Any

from oneiter.errors import OneIterError
from oneiter.profile.module_ranges import FWD, display_path, module_path, split_marker

__all__ = [
    "MEMORY_SORTS",
    "build_tables",
    "op_table",
    "memory_table",
    "module_table",
    "profiler_steps",
    "format_ops",
    "format_memory",
    "format_modules",
]

MEMORY_SORTS = ("self_cpu_memory", "cpu_memory", "self_device_memory", "device_memory")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def _is_op(evt) -> bool:
    name = evt.name
    return not (
        getattr(evt, "is_user_annotation", False)
        or getattr(evt, "is_python_function", False)
        or name.startswith("oneiter.")
        or name.startswith("ProfilerStep")
        or name == "[memory]"
    )


def profiler_steps(events) -> list[int]:
    """The step numbers N of the `ProfilerStep#N` ranges present in the events."""
    return sorted({int(m.group(1)) for m in (_STEP.match(_trace_name(e)) for e in events) if m})


def _trace_name(evt) -> str:
    # FunctionEvent.name is rewritten to "ProfilerStep*"; trace_name keeps the step number.
    return getattr(evt, "trace_name", None) or evt.name


def op_table(events, num_steps: int, *, by_shape: bool = False) -> list[dict[str, Any]]:
    """Aggregate op events by name (and input shapes); sorted by self device time, then self CPU time."""
    rows: dict[tuple, dict[str, Any]] = {}
    for evt in events:
        if not _is_op(evt):
            continue
        shapes = str(evt.input_shapes) if by_shape else None
        row = rows.get((evt.name, shapes))
        if row is None:
            row = rows[(evt.name, shapes)] = {
                "name": evt.name, "input_shapes": shapes, "calls": 0.0,
                "self_cpu_us": 0.0, "cpu_total_us": 0.0, "self_device_us": 0.0, "device_total_us": 0.0,
                "self_cpu_memory": 0.0, "cpu_memory": 0.0, "self_device_memory": 0.0, "device_memory": 0.0,
                "flops": 0.0,
            }  # fmt: skip
        row["calls"] += 1
        row["self_cpu_us"] += evt.self_cpu_time_total
        row["cpu_total_us"] += evt.cpu_time_total
        row["self_device_us"] += evt.self_device_time_total
        row["device_total_us"] += evt.device_time_total
        row["self_cpu_memory"] += evt.self_cpu_memory_usage
        row["cpu_memory"] += evt.cpu_memory_usage
        row["self_device_memory"] += evt.self_device_memory_usage
        row["device_memory"] += evt.device_memory_usage
        row["flops"] += evt.flops or 0
    out = [_per_step(row, num_steps) for row in rows.values()]
    out.sort(key=lambda r: (-r["self_device_us"], -r["self_cpu_us"], r["name"], r["input_shapes"] or ""))
    return out


def _per_step(row: dict[str, Any], num_steps: int) -> dict[str, Any]:
    return {k: (v / num_steps if isinstance(v, float) else v) for k, v in row.items()}


def memory_table(op_rows: list[dict[str, Any]], sort_by: str = "self_cpu_memory") -> list[dict[str, Any]]:
    """Op rows whose memory column `sort_by` is nonzero, largest first."""
    if sort_by not in MEMORY_SORTS:
        raise OneIterError(f"--memory-sort must be one of {', '.join(MEMORY_SORTS)}, got '{sort_by}'")
    rows = [r for r in op_rows if r[sort_by]]
    return sorted(rows, key=lambda r: (-r[sort_by], r["name"], r["input_shapes"] or ""))


class _MemoryIndex:
    """Prefix sums of allocation events over time: net bytes allocated in any [start, end] in O(log n)."""

    def __init__(self, records: list[tuple[float, int, int]]):
        records = sorted(records)
        self.times = [t for t, _, _ in records]
        self.cpu = [0]
        self.device = [0]
        for _, cpu, dev in records:
            self.cpu.append(self.cpu[-1] + cpu)
            self.device.append(self.device[-1] + dev)

    def between(self, start: float, end: float) -> tuple[int, int]:
        lo, hi = bisect.bisect_left(self.times, start), bisect.bisect_right(self.times, end)
        return self.cpu[hi] - self.cpu[lo], self.device[hi] - self.device[lo]


def memory_records(prof) -> list[tuple[float, int, int]]:
    """(time in µs from trace start, CPU bytes, device bytes) of every allocation (+) and free (-) event."""
    from torch.autograd import DeviceType

    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        return []
    start_ns = results.trace_start_ns()
    cpu_types = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    out = []
    for evt in results.events():
        if evt.name() == "[memory]":
            nbytes, on_cpu = evt.nbytes(), evt.device_type() in cpu_types
            out.append(((evt.start_ns() - start_ns) / 1000, nbytes if on_cpu else 0, 0 if on_cpu else nbytes))
    return out


class _DeviceIndex:
    """Self device time of the CPU events of each thread, by start time: device time launched in an interval."""

    def __init__(self, events):
        from torch.autograd import DeviceType

        per_thread: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for evt in events:  # kernels count through the CPU op that launched them, once
            if evt.device_type == DeviceType.CPU and evt.self_device_time_total and _is_op(evt):
                per_thread[evt.thread].append((evt.time_range.start, evt.self_device_time_total))
        self.index = {}
        for thread, items in per_thread.items():
            items.sort()
            sums = [0.0]
            for _, value in items:
                sums.append(sums[-1] + value)
            self.index[thread] = ([t for t, _ in items], sums)

    def between(self, thread: int, start: float, end: float) -> float:
        if thread not in self.index:
            return 0.0
        times, sums = self.index[thread]
        return sums[bisect.bisect_right(times, end)] - sums[bisect.bisect_left(times, start)]


def _module_intervals(events) -> dict[tuple[str, str], list[tuple[int, float, float]]]:
    """(direction, path) -> [(thread, start µs, end µs)] from forward ranges and backward marker pairs."""
    out: dict[tuple[str, str], list] = defaultdict(list)
    begins: dict[str, Any] = {}
    for evt in events:
        name = evt.name
        marker = split_marker(name)
        if name.startswith(FWD):
            out[("fwd", module_path(name[len(FWD):]))].append((evt.thread, evt.time_range.start, evt.time_range.end))
        elif marker is not None and marker[0] == "begin":
            begins[marker[1]] = evt
        elif marker is not None:
            label = marker[1]
            begin = begins.pop(label, None)
            if begin is not None:
                path = module_path(label.rpartition("@")[0])
                out[("bwd", path)].append((begin.thread, begin.time_range.start, evt.time_range.start))
    return out


def module_table(
    events, num_steps: int, module_info: dict[str, tuple[str, bool]], memory: list | None = None
) -> list[dict[str, Any]]:
    """One row per module path (`module_info`: path -> (class name, is leaf)), in `named_modules()` order."""
    intervals = _module_intervals(events)
    mem = _MemoryIndex(memory) if memory is not None else None
    dev = _DeviceIndex(events)
    has_device = bool(dev.index)
    rows = []
    for path, (type_name, leaf) in module_info.items():
        row: dict[str, Any] = {"path": path, "type": type_name, "leaf": leaf}
        for direction in ("fwd", "bwd"):
            spans = intervals.get((direction, path), [])
            row[f"{direction}_calls"] = len(spans) / num_steps
            row[f"{direction}_us"] = sum(end - start for _, start, end in spans) / num_steps
            if mem is not None:
                used = [mem.between(start, end) for _, start, end in spans]
                row[f"{direction}_cpu_memory"] = sum(u[0] for u in used) / num_steps
                row[f"{direction}_device_memory"] = sum(u[1] for u in used) / num_steps
            if has_device:
                row[f"{direction}_device_us"] = sum(dev.between(*span) for span in spans) / num_steps
        rows.append(row)
    return rows


def build_tables(prof, num_steps: int, module_info: dict, *, by_shape: bool, memory_sort: str | None) -> dict:
    """All tables of the cycle `prof` just recorded. `memory_sort` None means memory was not profiled."""
    events = prof.events()
    ops = op_table(events, num_steps, by_shape=by_shape)
    memory = memory_records(prof) if memory_sort is not None else None
    steps = [e for e in events if _STEP.match(_trace_name(e))]
    return {
        "profiler_steps": profiler_steps(events),
        "step_us": sum(e.cpu_time_total for e in steps) / max(len(steps), 1),
        "ops": ops,
        "memory": memory_table(ops, memory_sort) if memory_sort is not None else [],
        "modules": module_table(events, num_steps, module_info, memory) if module_info else [],
    }


# text --------------------------------------------------------------------------------------------------------
def _ms(us: float) -> str:
    return f"{us / 1000:10.3f}"


def _mib(nbytes: float | None) -> str:
    return f"{'-':>10}" if nbytes is None else f"{nbytes / 2**20:10.2f}"


def _limited(rows: list, limit: int | None) -> tuple[list, str]:
    if limit is None or len(rows) <= limit:
        return rows, ""
    return rows[:limit], f"... {len(rows) - limit} more rows in the .tables.txt file and summary.json\n"


def format_ops(rows: list[dict], limit: int | None = None, *, device: bool = False) -> str:
    """Fixed-width op table: ms and calls per step."""
    shown, more = _limited(rows, limit)
    dev_head = f" {'self dev':>10} {'total dev':>10}" if device else ""
    lines = [f"{'self CPU':>10} {'total CPU':>10}{dev_head} {'calls':>7}  op (ms per step)"]
    for r in shown:
        dev_cols = f" {_ms(r['self_device_us'])} {_ms(r['device_total_us'])}" if device else ""
        shapes = f"  {r['input_shapes']}" if r["input_shapes"] else ""
        lines.append(f"{_ms(r['self_cpu_us'])} {_ms(r['cpu_total_us'])}{dev_cols} {r['calls']:7.0f}  "
                     f"{r['name']}{shapes}")
    return "\n".join(lines) + "\n" + more


def format_memory(rows: list[dict], sort_by: str, limit: int | None = None, *, device: bool = False) -> str:
    """Fixed-width memory table: MiB per step (allocated minus freed), sorted by `sort_by`."""
    shown, more = _limited(rows, limit)
    keys = MEMORY_SORTS if device or "device" in sort_by else MEMORY_SORTS[:2]
    heads = {"self_cpu_memory": "self CPU", "cpu_memory": "CPU", "self_device_memory": "self dev",
             "device_memory": "device"}
    lines = [" ".join(f"{heads[k]:>10}" for k in keys) + f" {'calls':>7}  op (MiB per step, by {sort_by})"]
    for r in shown:
        shapes = f"  {r['input_shapes']}" if r["input_shapes"] else ""
        lines.append(" ".join(_mib(r[k]) for k in keys) + f" {r['calls']:7.0f}  {r['name']}{shapes}")
    return "\n".join(lines) + "\n" + more


def format_modules(rows: list[dict], limit: int | None = None, *, slowest_leaves: bool = False) -> str:
    """Fixed-width module table: forward/backward ms (device ms where a device ran) and MiB per step. Model order
    with every module, or `slowest_leaves`: leaf modules only (no time counted twice), slowest first."""
    timing = "device_us" if rows and "fwd_device_us" in rows[0] else "us"
    if slowest_leaves:
        rows = sorted((r for r in rows if r["leaf"]),
                      key=lambda r: (-(r[f"fwd_{timing}"] + r[f"bwd_{timing}"]), r["path"]))
    shown, more = _limited(rows, limit)
    memory = "" if not rows or "fwd_cpu_memory" not in rows[0] else "cpu"
    if memory and any(r["fwd_device_memory"] or r["bwd_device_memory"] for r in rows):
        memory = "device"
    unit = "dev ms" if timing == "device_us" else "ms"
    mem_head = f" {'fwd MiB':>10} {'bwd MiB':>10}" if memory else ""
    per_step = f"per step{', ' + memory + ' memory' if memory else ''}"
    lines = [f"{'fwd ' + unit:>10} {'bwd ' + unit:>10}{mem_head} {'calls':>5}  module ({per_step})"]
    for r in shown:
        mem_cols = f" {_mib(r[f'fwd_{memory}_memory'])} {_mib(r[f'bwd_{memory}_memory'])}" if memory else ""
        lines.append(
            f"{_ms(r[f'fwd_{timing}'])} {_ms(r[f'bwd_{timing}'])}{mem_cols} {r['fwd_calls']:5.0f}  "
            f"{display_path(r['path'])} ({r['type']})"
        )
    return "\n".join(lines) + "\n" + more
