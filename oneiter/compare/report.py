"""Presentation of a `CompareResult`: the terminal report, the JSON document and the CSV table.

Sits after the engine (`engine.compare_files`) and before the CLI (`oneiter.cli.compare_cmd`), which only chooses
where output goes. The terminal report puts the verdict first, then the rows around the first divergence (5 before,
10 after) or, for a match, the rows with the largest relative errors; `show_all` prints every row. Numbers are in
fixed-width scientific notation so columns line up and diffs of two reports stay readable.

Reading a report (ResNet-18, a 5 % error injected into `layer2.0.conv1`'s output)::

    DIVERGED at layer2.0.conv1@0 forward output: max_abs 4.55e-01 max_rel 4.76e-02 rel_l2 5.00e-02 cosine 1.000000,
    99.98% of elements outside atol 1.0e-05 rtol 1.3e-06 (would pass with atol 4.5e-01 or rtol 5.0e-02)
    reference ref.h5 (model resnet18, device cpu, dtype float32, num_threads 2, loss 3.476078e+00)
    target    fwd.h5 (model resnet18, device cpu, dtype float32, num_threads 2, loss 3.476076e+00)
    entries   486: 204 match, 282 diverged
       #  entry                              status      max_abs    max_rel     rel_l2     cosine      out ...
      41  layer2.0.conv1@0 forward input.0   match      0.00e+00   0.00e+00   0.00e+00   1.000000    0.00% ...
     >42  layer2.0.conv1@0 forward output    diverged   4.55e-01   4.76e-02   5.00e-02   1.000000   99.98% ...

Walking the iteration in causal order (forward as executed, backward as the gradients were computed, parameter
gradients, updated parameters), row 42 is the first tensor outside tolerance: its input matched, its output did
not, so the layer that produced it (`layer2.0.conv1`, first call) is where to look. Later rows usually diverge as
a consequence. rel_l2 (error norm / reference norm) says how large the error is; cosine near 1 with a large rel_l2
means a scale error. A `hint:` line follows the verdict when the error is no larger than rounding noise (10x
rtol), e.g. two runs with different thread counts.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .engine import CompareResult, Row
from .metrics import Metrics

__all__ = [
    "to_json", "write_csv", "print_report", "verdict_line", "noise_hint", "rows_to_show", "print_wide",
    "basis_lines", "focus_row",
    "BEFORE", "AFTER",
]

BEFORE, AFTER, TOP = 5, 10, 10  # rows shown before/after the first divergence; largest errors shown on a match


def _safe(text: str) -> str:
    """Names read from a damaged file can hold undecodable bytes (surrogates): show them escaped, never crash."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _sci(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:9.2e}"


# -- JSON / CSV -----------------------------------------------------------------------------------------------------
def _finite(value: Any) -> Any:
    """JSON has no inf/nan: they become the strings "inf", "-inf", "nan" (float() reads them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(result: CompareResult) -> dict[str, Any]:
    """The machine-readable report: verdict, inputs, per-status counts and every row in causal order."""
    rows = [{"index": i, **row.as_dict(), "local": _local_dict(result, row)} for i, row in enumerate(result.rows)]
    verdict = result.verdict()
    hint = noise_hint(result)
    if hint:
        verdict["hint"] = hint
    return _finite({
        "verdict": verdict,
        "reference": result.reference,
        "target": result.target,
        "meta": {"reference": result.meta_reference, "target": result.meta_target},
        "loss": result.loss,
        "counts": result.counts(),
        "rows": rows,
    })


def _local_dict(result: CompareResult, row: Row) -> Optional[dict[str, Any]]:
    local = result.local_for(row)
    return None if local is None else local.as_dict()



def write_csv(result: CompareResult, path: str | Path) -> None:
    """One line per row, causal order; shapes as `8x64x56x56`."""
    rows = [{"index": i, **row.as_dict()} for i, row in enumerate(result.rows)]
    with open(path, "w", encoding="utf-8", errors="backslashreplace", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["index"])
        writer.writeheader()
        for data in rows:
            for key in ("shape", "shape_target"):
                data[key] = "" if data[key] is None else "x".join(str(s) for s in data[key]) or "scalar"
            writer.writerow(data)


# -- terminal -------------------------------------------------------------------------------------------------------
def verdict_line(result: CompareResult) -> str:
    """One line: MATCH with what was checked, or DIVERGED naming the culprit (or module@call, phase, tensor)."""
    row = result.divergence
    culprit = result.culprit
    if culprit is not None and row is None:
        return (f"DIVERGED: culprit {culprit.module}@{culprit.call} {culprit.phase} {culprit.tensor}: "
                f"{_culprit_reason(culprit)}")
    if row is None and result.basis == "unattributed":
        return f"DIVERGED (unattributed): no call's own code is to blame, but {result.loss_reason}"
    if row is None and result.basis == "local_error":
        if not result.local:
            return "MATCH: no call could be judged (see the calls not probed below)"
        worst = max(result.local, key=lambda r: r.ratio)
        return (f"MATCH: no call's own error exceeds its expected noise x{worst.factor:g} ({len(result.local)} "
                f"tensors judged; highest ratio {worst.ratio:.1f}x at {worst.module}@{worst.call} "
                f"{worst.phase} {worst.tensor})")
    if row is None:
        worst = max((r.metrics.rel_l2 for r in result.rows if r.metrics), default=0.0)
        return f"MATCH: all {len(result.rows)} entries within tolerance (largest rel_l2 {worst:.2e})"
    if result.basis == "unattributed":
        return (f"DIVERGED (unattributed) at {row.module}@{row.call} {row.phase} {row.tensor}: no call's own code "
                f"is to blame, but this entry's {result.unexplained[0][1]}")
    head = f"DIVERGED at {row.module}@{row.call} {row.phase} {row.tensor}"
    m = row.metrics
    if m is None:
        return f"{head}: {row.status.replace('_', ' ')} ({row.reason})"
    tol = row.tolerance
    numbers = (
        f"max_abs {m.max_abs:.2e} max_rel {m.max_rel:.2e} rel_l2 {m.rel_l2:.2e} cosine {m.cosine:.6f}, "
        f"{m.frac_out:.2%} of elements outside atol {tol.atol:.1e} rtol {tol.rtol:.1e}"
    )
    extra = ""
    if m.nonfinite_differs:
        extra = f"; NaN {m.num_nan_ref} vs {m.num_nan_target}, Inf {m.num_inf_ref} vs {m.num_inf_target}"
    return f"{head}: {numbers} (would pass with atol {m.need_atol:.1e} or rtol {m.need_rtol:.1e}){extra}"


def _culprit_reason(culprit) -> str:
    if culprit.metrics.nonfinite_differs:
        return (f"{culprit.metrics.num_mismatch} NaN/Inf at other positions (or with another sign) than in the "
                f"reference, given the same inputs")
    own = "its own code's"
    child = culprit.tensor.partition(":")[0] if ":" in culprit.tensor else None
    if child:
        own = f"its own code's (what it hands {child})"
    return (f"{own} error rel_l2 {culprit.rel_l2:.2e}, on the reference's inputs, is {culprit.ratio:.1f}x its "
            f"expected noise {culprit.expected:.2e}")


def rows_to_show(result: CompareResult, *, show_all: bool = False) -> tuple[list[int], str]:
    """Indices of the rows to print and a caption saying what was left out."""
    num = len(result.rows)
    if show_all:
        return list(range(num)), ""
    k = focus_row(result)
    if k is not None:
        start, stop = max(0, k - BEFORE), min(num, k + AFTER + 1)
        hidden = num - (stop - start)
        what = "the culprit" if result.culprit is not None and result.divergence is None else "the first divergence"
        caption = f"rows {start}-{stop - 1} of {num} around {what}"
        return list(range(start, stop)), caption + (f"; {hidden} more not shown (--all)" if hidden else "")
    measured = [i for i, r in enumerate(result.rows) if r.metrics is not None]
    top = sorted(sorted(measured, key=lambda i: -result.rows[i].metrics.rel_l2)[:TOP])
    hidden = num - len(top)
    caption = f"the {len(top)} entries with the largest rel_l2"
    caption += f"; {hidden} more not shown (--all)" if hidden else ""
    return top, caption


def focus_row(result: CompareResult) -> Optional[int]:
    """The row the report centres on: the culprit's, else the divergent row the verdict names."""
    if result.culprit is not None and result.divergence is None:
        key = result.culprit.row_key
        return next((i for i, r in enumerate(result.rows) if (r.module, r.call, r.phase, r.tensor) == key), None)
    if result.divergence is not None:
        return result.rows.index(result.divergence)
    return None


def _dims(shape: Optional[tuple]) -> str:
    return "-" if shape is None else ("x".join(str(s) for s in shape) or "scalar")


def _pair(ref: str, tgt: str) -> str:
    return ref if ref == tgt else f"{ref}|{tgt}"


def _nonfinite(m: Optional[Metrics]) -> str:
    if m is None or not (m.num_nan_ref or m.num_inf_ref or m.num_nan_target or m.num_inf_target):
        return ""
    return f"{m.num_nan_ref}/{m.num_inf_ref}|{m.num_nan_target}/{m.num_inf_target}"


def _table(result: CompareResult, indices: list[int], caption: str) -> Table:
    """Columns by importance, left to right: a narrow terminal crops the least useful ones."""
    table = Table(caption=caption or None, caption_justify="left", header_style="bold", box=None, pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("entry", overflow="fold", min_width=16)
    table.add_column("status", no_wrap=True)
    for name in ("max_abs", "max_rel", "rel_l2", "cosine", "out"):
        table.add_column(name, justify="right", no_wrap=True, min_width=7 if name == "out" else 9)
    table.add_column("nan/inf", no_wrap=True)
    if result.local:
        for name in ("local", "noise", "ratio"):
            table.add_column(name, justify="right", no_wrap=True, min_width=9 if name != "ratio" else 6)
    table.add_column("shape", overflow="fold", min_width=5)
    table.add_column("dtype", overflow="fold", min_width=7)
    for i in indices:
        cells = _cells(result.rows[i], i)
        if result.local:
            local = result.local_for(result.rows[i])
            cells[9:9] = ["-"] * 3 if local is None else [
                _sci(local.rel_l2), _sci(local.expected), f"{local.ratio:5.1f}x" + ("!" if local.flagged else " ")]
        if i == focus_row(result):
            cells[0] = f">{i}"  # visible without colour too (pipes, CI logs)
        table.add_row(*cells, style=_style(result, i))
    return table


def _cells(row: Row, index: int) -> list[str]:
    m = row.metrics
    if row.shape is not None and row.shape_target is not None:
        shape = _pair(_dims(row.shape), _dims(row.shape_target))
    else:
        shape = _dims(row.shape or row.shape_target)
    dtype = _pair(row.dtype or "-", row.dtype_target or "-")
    numbers = ["-"] * 5 if m is None else [
        _sci(m.max_abs), _sci(m.max_rel), _sci(m.rel_l2), f"{m.cosine:9.6f}", f"{m.frac_out:7.2%}"]
    return [str(index), _safe(row.name), row.status, *numbers, _nonfinite(m), shape, dtype]


def _style(result: CompareResult, index: int) -> str:
    if index == focus_row(result) and result.status != "match":
        return "bold red"
    local = result.local_for(result.rows[index]) if result.local else None
    if local is not None and local.flagged:
        return "red"
    return "yellow" if result.rows[index].diverged and result.basis != "local_error" else ""


_SHOWN_META = ("model", "device", "dtype", "amp", "num_threads")


def _describe(meta: dict) -> str:
    return ", ".join(f"{k} {meta[k]}" for k in _SHOWN_META if meta.get(k) not in (None, ""))


def noise_hint(result: CompareResult) -> Optional[str]:
    """A hint when the first divergence is no larger than rounding noise (it may not be a bug at all)."""
    row = result.divergence
    if row is None or row.metrics is None or row.metrics.nonfinite_differs or row.tolerance is None:
        return None
    if result.basis == "local_error":
        return None
    m, tol = row.metrics, row.tolerance
    if not m.rel_l2 <= 10 * tol.rtol:
        return None
    threads = result.meta_reference.get("num_threads"), result.meta_target.get("num_threads")
    cause = (f"the runs used {threads[0]} and {threads[1]} threads, which changes reduction order"
             if None not in threads and threads[0] != threads[1]
             else "a different reduction order (threads, kernels) changes results this much")
    return (f"hint: rel_l2 {m.rel_l2:.1e} is within 10x rtol {tol.rtol:.1e}, rounding-noise size: {cause}; "
            f"--rtol/--atol loosen the check")


def basis_lines(result: CompareResult) -> list[str]:
    """What the verdict rests on, the NaN/Inf origin, and the accumulated first divergence when it is not the verdict."""
    lines = []
    if result.nan_origin:
        o = result.nan_origin
        lines.append(f"NaN/Inf origin: {o['module']}@{o['call']} {o['phase']} {o['tensor']} (its inputs are finite)")
    if result.basis == "first_divergence":
        lines.append("basis: first divergence in causal order (no per-layer local data: record the target with "
                     "--replay, or --against cpu, to name the culprit layer)")
        return lines
    kind = "teacher-forced replay" if result.local_kind == "teacher_forced" else "recomputation on the CPU in float32"
    flagged = sum(r.flagged for r in result.local)
    calls = len({(r.module, r.call) for r in result.local if r.phase in ("forward", "backward")})
    lines.append(f"basis: each call's own error ({kind}): {len(result.local)} tensors of {calls} calls judged, "
                 f"{flagged} above their expected noise")
    if result.culprit_includes:
        names = ", ".join(f"{u['module']}@{u['call']}" for u in result.culprit_includes)
        lines.append(f"the culprit's rerun includes {names}, which could not be probed alone (see below): the "
                     f"difference may be there")
    if len(result.chain) > 1:
        outer = " < ".join(f"{c['module']}@{c['call']}" for c in result.chain[1:])
        lines.append(f"inside: {outer} (their own code is within noise)" if not any(
            c["flagged"] for c in result.chain[1:]) else f"inside: {outer}")
    if result.unprobed:
        shown = "; ".join(f"{u['module']}@{u['call']}: {u['reason']}" for u in result.unprobed[:3])
        more = f"; {len(result.unprobed) - 3} more in the JSON report" if len(result.unprobed) > 3 else ""
        lines.append(f"not probed ({len(result.unprobed)} calls, judged by error growth only): {shown}{more}")
    first = result.first_divergence
    if first is not None and (result.divergence is None or result.rows.index(result.divergence) != first):
        row = result.rows[first]
        rel = f" (rel_l2 {row.metrics.rel_l2:.2e})" if row.metrics else ""
        lines.append(f"accumulated: first outside tolerance at #{first} {row.name}{rel}: drift, not a verdict")
    return lines


def print_report(console: Console, result: CompareResult, *, show_all: bool = False) -> None:
    """Verdict, inputs, counts, then the table of the rows that matter."""
    style = "bold green" if result.status == "match" else "bold red"
    console.print(Text(_safe(verdict_line(result)), style=style))
    hint = noise_hint(result)
    if hint:
        console.print(Text(hint, style="yellow"))
    for line in basis_lines(result):
        console.print(Text(_safe(line), style="yellow" if line.startswith("NaN") else ""))
    for label, path, meta in (("reference", result.reference, result.meta_reference),
                              ("target", result.target, result.meta_target)):
        loss = result.loss.get(label)
        loss_text = f", loss {loss:.6e}" if loss is not None else ""
        console.print(Text(_safe(f"{label:<9} {path} ({_describe(meta)}{loss_text})")))
    counts = ", ".join(f"{n} {status}" for status, n in result.counts().items() if n)
    console.print(Text(f"entries   {len(result.rows)}: {counts}"))
    indices, caption = rows_to_show(result, show_all=show_all)
    if indices:
        print_wide(console, _table(result, indices, caption))


def print_wide(console: Console, table: Table) -> None:
    """Print a table; into a file or pipe at its natural width instead of squeezing it into 80 columns."""
    if console.is_terminal:
        console.print(table)
        return
    Console(file=console.file, width=10_000, highlight=False, color_system=None).print(table)
