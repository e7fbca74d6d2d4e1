"""`oneiter profile diff A B`: two profile directories aligned by module path and by op name.

Where it sits: reads the `summary.json` that `runner.profile` wrote in each directory (say a reference device and
a target device, or float32 and bfloat16) and pairs the rows: time and memory on each side, B/A ratio, and what
exists on one side only. Several cycles in one profile are averaged, so both sides are "per step".

Time on each side is device time when that side recorded any (a kernel's duration is what a port changes), else
CPU time; the header says which. Module time is forward plus backward; module memory is the forward's net
allocation (the activations a module keeps for backward), present only for profiles taken with --profile-memory.
Ops are aligned by name alone (input shapes differ between runs by design, and are summed).

Each side carries its own noise verdict (the overhead measurement of `oneiter profile` and the framework callbacks:
how much its steps varied): the step-time ratio is marked "within noise" when a side's steps were not steady.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oneiter.profile.module_ranges import display_path
from oneiter.profile.profile_session import NOISY_SPREAD
from oneiter.profile.summary import read_summary

__all__ = ["ProfileDiff", "diff_profiles", "format_diff", "DIFF_SORTS", "is_leaf"]

DIFF_SORTS = ("delta", "ratio", "model")


@dataclass
class ProfileDiff:
    """Aligned rows of two profiles; `a` and `b` describe each side (directory, model, device, dtype, ...)."""

    a: dict[str, Any]
    b: dict[str, Any]
    modules: list[dict[str, Any]] = field(default_factory=list)
    modules_only_a: list[dict[str, Any]] = field(default_factory=list)  # {path, type, us}
    modules_only_b: list[dict[str, Any]] = field(default_factory=list)
    ops: list[dict[str, Any]] = field(default_factory=list)
    ops_only_a: list[dict[str, Any]] = field(default_factory=list)  # {name, calls, self_us}
    ops_only_b: list[dict[str, Any]] = field(default_factory=list)

    @property
    def module_alignment(self) -> float:
        """Share of module rows present on both sides (1.0 when neither side has module rows)."""
        total = len(self.modules) + len(self.modules_only_a) + len(self.modules_only_b)
        return len(self.modules) / total if total else 1.0

    @property
    def op_alignment(self) -> float:
        total = len(self.ops) + len(self.ops_only_a) + len(self.ops_only_b)
        return len(self.ops) / total if total else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b,
            "module_alignment": round(self.module_alignment, 4), "op_alignment": round(self.op_alignment, 4),
            "modules": self.modules, "modules_only_a": self.modules_only_a, "modules_only_b": self.modules_only_b,
            "ops": self.ops, "ops_only_a": self.ops_only_a, "ops_only_b": self.ops_only_b,
        }  # fmt: skip


def _ratio(a: float, b: float) -> float | None:
    return float(f"{b / a:.4g}") if a > 0 else None  # 4 significant digits: a small ratio keeps its precision


def _uses_device(summary: dict) -> bool:
    return any(r.get("self_device_us") for c in summary["cycles"] for r in c["ops"])


def _side(directory: Path, summary: dict) -> dict[str, Any]:
    cycles = summary["cycles"]
    return {
        "dir": str(directory), "model": summary["model"], "device": summary["device"], "dtype": summary["dtype"],
        "amp": summary["amp"], "batch_size": summary["batch_size"],
        "time": "device" if _uses_device(summary) else "cpu",
        "step_us": sum(c["step_us"] for c in cycles) / len(cycles),
        **_noise(summary),
    }  # fmt: skip


def _noise(summary: dict) -> dict[str, Any]:
    """How steady that side's steps were, from its own overhead measurement: `noise` (its verdict, as `oneiter
    profile` printed it), `spread` ((max - min) / median of its steps, the larger of profiled and unprofiled) and
    `steady` (at least 2 recorded steps, spread at most NOISY_SPREAD: a step time that means something)."""
    o = summary.get("overhead") or {}
    spreads = [v for v in (o.get("profiled_spread"), o.get("unprofiled_spread")) if v is not None]
    spread = max(spreads) if spreads else None
    steady = spread is not None and spread <= NOISY_SPREAD and int(o.get("num_profiled") or 0) >= 2
    return {"noise": o.get("verdict") or "not measured (no unprofiled steps were timed)", "spread": spread,
            "steady": steady}


def _mean_modules(summary: dict, device_time: bool) -> dict[str, dict[str, Any]]:
    """path -> {type, fwd_us, bwd_us, memory}, averaged over cycles; model order kept."""
    out: dict[str, dict[str, Any]] = {}
    cycles = summary["cycles"]
    for cycle in cycles:
        for r in cycle["modules"]:
            row = out.setdefault(r["path"], {"type": r["type"], "fwd_us": 0.0, "bwd_us": 0.0, "memory": None})
            suffix = "_device_us" if device_time else "_us"
            row["fwd_us"] += (r.get("fwd" + suffix) or 0.0) / len(cycles)
            row["bwd_us"] += (r.get("bwd" + suffix) or 0.0) / len(cycles)
            if "fwd_cpu_memory" in r:
                memory = r["fwd_cpu_memory"] + r["fwd_device_memory"]
                row["memory"] = (row["memory"] or 0.0) + memory / len(cycles)
    return out


def _mean_ops(summary: dict, device_time: bool) -> dict[str, dict[str, Any]]:
    """op name -> {calls, self_us, total_us, self_memory}, input shapes summed, averaged over cycles."""
    out: dict[str, dict[str, Any]] = {}
    cycles = summary["cycles"]
    memory = summary["options"].get("profile_memory", False)
    prefix = "device" if device_time else "cpu"
    for cycle in cycles:
        for r in cycle["ops"]:
            row = out.setdefault(r["name"], {"calls": 0.0, "self_us": 0.0, "total_us": 0.0, "self_memory": None})
            row["calls"] += r["calls"] / len(cycles)
            row["self_us"] += r[f"self_{prefix}_us"] / len(cycles)
            row["total_us"] += r[f"{prefix}_total_us"] / len(cycles)
            if memory:
                self_memory = r["self_cpu_memory"] + r["self_device_memory"]
                row["self_memory"] = (row["self_memory"] or 0.0) + self_memory / len(cycles)
    return out


def diff_profiles(dir_a: Path | str, dir_b: Path | str) -> ProfileDiff:
    """Align the profiles in `dir_a` (reference) and `dir_b` (target) by module path and op name."""
    sum_a, sum_b = read_summary(Path(dir_a)), read_summary(Path(dir_b))
    side_a, side_b = _side(Path(dir_a), sum_a), _side(Path(dir_b), sum_b)
    dev_a, dev_b = side_a["time"] == "device", side_b["time"] == "device"
    diff = ProfileDiff(side_a, side_b)
    diff.modules, diff.modules_only_a, diff.modules_only_b = _align(
        _mean_modules(sum_a, dev_a), _mean_modules(sum_b, dev_b), _module_pair, _one_sided_module)
    diff.ops, diff.ops_only_a, diff.ops_only_b = _align(
        _mean_ops(sum_a, dev_a), _mean_ops(sum_b, dev_b), _op_pair, _one_sided_op)
    for rows in (diff.ops_only_a, diff.ops_only_b):
        rows.sort(key=lambda r: (-r["self_us"], r["name"]))
    paths = {r["path"] for rows in (diff.modules, diff.modules_only_a, diff.modules_only_b) for r in rows}
    for row in diff.modules:
        row["leaf"] = is_leaf(row["path"], paths)  # leaves and containers are ranked apart (`format_diff`)
    return diff


def _align(rows_a: dict, rows_b: dict, pair, one_sided) -> tuple[list, list, list]:
    """Rows present on both sides (in A's order), then those only in A, then those only in B."""
    both = [pair(key, ra, rows_b[key]) for key, ra in rows_a.items() if key in rows_b]
    only_a = [one_sided(key, ra) for key, ra in rows_a.items() if key not in rows_b]
    only_b = [one_sided(key, rb) for key, rb in rows_b.items() if key not in rows_a]
    return both, only_a, only_b


def _module_pair(path: str, ra: dict, rb: dict) -> dict[str, Any]:
    a_us, b_us = ra["fwd_us"] + ra["bwd_us"], rb["fwd_us"] + rb["bwd_us"]
    return {
        "path": path, "type": ra["type"] if ra["type"] == rb["type"] else f"{ra['type']}/{rb['type']}",
        "a_fwd_us": ra["fwd_us"], "a_bwd_us": ra["bwd_us"], "b_fwd_us": rb["fwd_us"], "b_bwd_us": rb["bwd_us"],
        "a_us": a_us, "b_us": b_us, "delta_us": b_us - a_us, "ratio": _ratio(a_us, b_us),
        "a_memory": ra["memory"], "b_memory": rb["memory"],
    }  # fmt: skip


def _op_pair(name: str, ra: dict, rb: dict) -> dict[str, Any]:
    return {
        "name": name, "a_calls": ra["calls"], "b_calls": rb["calls"],
        "a_self_us": ra["self_us"], "b_self_us": rb["self_us"], "a_total_us": ra["total_us"],
        "b_total_us": rb["total_us"], "delta_us": rb["self_us"] - ra["self_us"],
        "ratio": _ratio(ra["self_us"], rb["self_us"]), "a_self_memory": ra["self_memory"],
        "b_self_memory": rb["self_memory"],
    }  # fmt: skip


def _one_sided_module(path: str, row: dict) -> dict[str, Any]:
    return {"path": path, "type": row["type"], "us": row["fwd_us"] + row["bwd_us"]}


def _one_sided_op(name: str, row: dict) -> dict[str, Any]:
    return {"name": name, "calls": row["calls"], "self_us": row["self_us"]}


# text --------------------------------------------------------------------------------------------------------
def _sorted(rows: list[dict], sort: str, key_name: str) -> list[dict]:
    if sort == "model":
        return rows
    if sort == "ratio":
        return sorted(rows, key=lambda r: (-(r["ratio"] or 0.0), r[key_name]))
    return sorted(rows, key=lambda r: (-abs(r["delta_us"]), r[key_name]))


def _ms(us: float) -> str:
    return f"{us / 1000:9.3f}"


def _x(ratio: float | None) -> str:
    return f"{'-':>8}" if ratio is None else f"{ratio:7.2f}x"


def _mib(nbytes: float | None) -> str:
    return f"{'-':>8}" if nbytes is None else f"{nbytes / 2**20:8.2f}"


def _describe(side: dict) -> str:
    amp = f", amp {side['amp']}" if side["amp"] else ""
    return (f"{side['dir']} ({side['model']}, {side['device']}, {side['dtype']}{amp}, batch {side['batch_size']}; "
            f"{side['time']} time)")


def format_diff(diff: ProfileDiff, limit: int | None = 20, sort: str = "delta") -> str:
    """The diff as fixed-width text: verdict line, module table, op table, one-sided names."""
    lines = _header_lines(diff)
    lines += _module_lines(diff, limit, sort)
    lines += _op_lines(diff, limit, sort)
    lines += _one_sided_lines(diff, limit)
    return "\n".join(lines) + "\n"


def _shown(rows: list, limit: int | None) -> list:
    """The first `limit` rows (all with no limit or 0)."""
    return rows[:limit] if limit else rows


def _more(rows: list, limit: int | None) -> list[str]:
    """The line saying how many rows `limit` left out, if any."""
    return [f"... {len(rows) - limit} more (--limit 0 shows all)"] if limit and len(rows) > limit else []


def _header_lines(diff: ProfileDiff) -> list[str]:
    """The verdict line (step time ratio, alignment of modules and ops), what each side profiled and how steady its
    steps were (each profile's own noise verdict: a ratio of two noisy step times says nothing)."""
    a, b = diff.a, diff.b
    noisy = [side for side, info in (("A", a), ("B", b)) if not info.get("steady", True)]
    caveat = f", within noise: {' and '.join(noisy)} not steady (below)" if noisy else ""
    return [
        f"step time B/A {_x(_ratio(a['step_us'], b['step_us'])).strip()}{caveat} "
        f"(A {a['step_us'] / 1000:.3f} ms, B {b['step_us'] / 1000:.3f} ms per step); "
        f"modules aligned {len(diff.modules)}/"
        f"{len(diff.modules) + len(diff.modules_only_a) + len(diff.modules_only_b)} "
        f"({diff.module_alignment:.1%}), ops aligned {len(diff.ops)}/"
        f"{len(diff.ops) + len(diff.ops_only_a) + len(diff.ops_only_b)} ({diff.op_alignment:.1%})",
        f"A: {_describe(a)}",
        f"B: {_describe(b)}",
        f"A steps: {a.get('noise', 'not measured')}",
        f"B steps: {b.get('noise', 'not measured')}",
    ]


def is_leaf(path: str, paths) -> bool:
    """Whether a module path has no child among `paths` (the model itself, "", contains every other one)."""
    prefix = f"{path}." if path else ""
    return not any(p != path and p.startswith(prefix) for p in paths)


def _module_lines(diff: ProfileDiff, limit: int | None, sort: str) -> list[str]:
    """The aligned module tables: leaves (the modules that run the ops) and containers (whose time holds their
    children's, so the model itself would top any one list) ranked apart."""
    header = f"{'A fwd':>9} {'A bwd':>9} {'B fwd':>9} {'B bwd':>9} {'B/A':>8} {'A MiB':>8} {'B MiB':>8}  module"
    lines = []
    for title, leaf in ((f"leaf modules: ms per step, sorted by {sort}", True),
                        (f"containers (their time includes their children's): ms per step, sorted by {sort}", False)):
        modules = _sorted([r for r in diff.modules if r.get("leaf", True) is leaf], sort, "path")
        if not modules:
            continue
        lines += ["", f"== {title} ==", header]
        for r in _shown(modules, limit):
            lines.append(
                f"{_ms(r['a_fwd_us'])} {_ms(r['a_bwd_us'])} {_ms(r['b_fwd_us'])} {_ms(r['b_bwd_us'])} "
                f"{_x(r['ratio'])} {_mib(r['a_memory'])} {_mib(r['b_memory'])}  {display_path(r['path'])} "
                f"({r['type']})"
            )
        lines += _more(modules, limit)
    return lines


def _op_lines(diff: ProfileDiff, limit: int | None, sort: str) -> list[str]:
    """The aligned op table."""
    lines = ["", f"== ops: self ms per step, sorted by {sort} ==",
             f"{'A self':>9} {'B self':>9} {'B/A':>8} {'A calls':>8} {'B calls':>8}  op"]  # fmt: skip
    ops = _sorted(diff.ops, sort, "name")
    for r in _shown(ops, limit):
        lines.append(
            f"{_ms(r['a_self_us'])} {_ms(r['b_self_us'])} {_x(r['ratio'])} {r['a_calls']:8.0f} {r['b_calls']:8.0f}  "
            f"{r['name']}"
        )
    return lines + _more(ops, limit)


def _one_sided_lines(diff: ProfileDiff, limit: int | None) -> list[str]:
    """Modules and ops that only one side has, and why there may be no module rows at all."""
    lines: list[str] = []
    for label, rows in (("modules only in A", diff.modules_only_a), ("modules only in B", diff.modules_only_b)):
        if rows:
            lines += ["", f"== {label} ({len(rows)}): ms per step =="]
            lines += [f"{_ms(r['us'])}  {display_path(r['path'])} ({r['type']})" for r in _shown(rows, limit)]
            lines += _more(rows, limit)
    if not diff.modules and (diff.modules_only_a or diff.modules_only_b):
        lines.append("(one side has no module rows: it was profiled with --no-module-ranges)")
    for label, rows in (("ops only in A", diff.ops_only_a), ("ops only in B", diff.ops_only_b)):
        if rows:
            lines += ["", f"== {label} ({len(rows)}): self ms per step =="]
            lines += [f"{_ms(r['self_us'])}  {r['name']}" for r in _shown(rows, limit)]
            lines += _more(rows, limit)
    return lines
