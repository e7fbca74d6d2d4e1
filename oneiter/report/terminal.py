"""Presentation of a `CompareResult`: the terminal report, the JSON document and the CSV table.

Sits after the engine and the verdict (`judge.iteration.verdict`, decided once per result) and before the CLI
(`oneiter.cli.compare_cmd`), which only chooses where output goes: nothing here decides anything. The terminal
report prints the verdict's headline and details, then the rows around the entry the verdict names (5 before, 10
after; marked `>`) or, for a match, the rows with the largest relative errors; numbers are in fixed-width
scientific notation so columns line up and two reports diff well. How to read a report: README ("What the demo
prints, and how to read it") and docs/reports.md.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from oneiter.formatting import sci
from oneiter.judge.iteration.entries import MEASURED, NOT_JUDGED, Row, nan_inf_text
from oneiter.judge.iteration.results import CompareResult
from oneiter.outputs import Destination, destination, open_text
from oneiter.report.impact_table import CSV_IMPACT, HEADERS, csv_columns, impact_cells
from oneiter.report.impact_table import caption as impact_caption

__all__ = ["to_json", "write_csv", "row_basis", "CSV_LOCAL", "print_report", "print_verdict", "print_impact",
           "rows_to_show",
           "print_wide", "plain_table", "metric_text", "safe_text", "cell", "BEFORE", "AFTER"]

BEFORE, AFTER, TOP = 5, 10, 10  # rows shown before/after the first divergence; largest errors shown on a match


# C0 and C1 control characters (ESC starts colour and cursor sequences, CR overprints a line), DEL, line and
# paragraph separators and the bidirectional overrides that reorder what a terminal shows
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape_char(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(text: object) -> str:
    """Text read from a file (module names, attributes, paths) as the terminal should show it: control characters
    as visible escapes (`\\x1b[31m` prints as those six characters, not as red) and undecodable bytes as
    `\\udcxx`; never crashes. Rich markup in it (`[bold]`) must still not be parsed: print it as a `Text`, with
    `markup=False`, or through `rich.markup.escape`."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(_escape_char, text)


def cell(text: object) -> Text:
    """A table cell holding file text: a `Text` (a plain `str` cell would be parsed as rich markup)."""
    return Text(safe_text(text))


# -- JSON / CSV -----------------------------------------------------------------------------------------------------
def to_json(result: CompareResult) -> dict[str, Any]:
    """The machine-readable report: verdict, inputs, per-status counts and every row in causal order; the result
    builds it (`CompareResult.to_json`), this module writes it and the CSV."""
    return result.to_json()


# the CSV's columns of the local error (`local_rel_l2`: what is judged, with a recipe its deviation from the recipe)
CSV_LOCAL = ("local_rel_l2", "expected_noise", "ratio", "flagged", "basis", "recipe", "format_cost")


def row_basis(result: CompareResult, index: int) -> str:
    """What a row's status rests on: `local_error` (its call's own error against its expected noise),
    `unattributed` (no probe covers it and the precision does not explain it), `tolerance` (its accumulated error
    against the dtype's tolerance: drift, or no local data), `structural` (missing, another shape or dtype) or
    `not_judged` (an update from another optimizer state)."""
    row = result.rows[index]
    if row.status == NOT_JUDGED:
        return NOT_JUDGED
    if row.status not in MEASURED:
        return "structural"
    if result.local_for(row) is not None:
        return "local_error"
    if any(u.get("index") == index for u in result.verdict_obj.unexplained):
        return "unattributed"
    return "tolerance"


def _csv_row(result: CompareResult, index: int) -> dict[str, Any]:
    """`row_dict`, with the local error, its expected noise, their ratio, the flag and the row's basis after
    `nan_inf`: what a spreadsheet needs to see why a row is `diverged`."""
    data = result.row_dict(index)
    local = result.local_for(result.rows[index])
    extra: dict[str, Any] = dict.fromkeys(CSV_LOCAL, "")
    if local is not None:
        extra.update({"local_rel_l2": local.error, "expected_noise": local.expected, "ratio": local.ratio,
                      "flagged": int(local.flagged), "recipe": local.recipe,
                      "format_cost": local.format_cost if local.recipe else ""})
    extra["basis"] = row_basis(result, index)
    keys = list(data)
    at = keys.index("nan_inf") + 1  # after the status, its role and the NaN/Inf counts; before the metrics
    row = result.rows[index]
    ranked = _ranked(result).get((row.module, row.call, row.phase, row.tensor), dict.fromkeys(CSV_IMPACT, ""))
    return {k: data[k] for k in keys[:at]} | extra | {k: data[k] for k in keys[at:]} | ranked


def _ranked(result: CompareResult) -> dict:
    """Row key -> its impact columns (`record --impact`: the entry each fix is named by), computed once."""
    found = getattr(result, "_csv_impact", None)
    if found is None:
        found = csv_columns(result.verdict_obj.impact)
        result._csv_impact = found  # type: ignore[attr-defined]  # a cache on the result: ranked once per report
    return found


def write_csv(result: CompareResult, path: str | Path | Destination) -> None:
    """One line per row, causal order; shapes as `8x64x56x56`; `role` marks the verdict's entry, the culprit and
    the first divergence; `nan_inf` (NaN/Inf counts, reference|target), then `local_rel_l2`, `expected_noise`,
    `ratio`, `flagged`, `basis` (`row_basis`), `recipe` and `format_cost` (a call that runs a low-precision recipe:
    `local_rel_l2` is its deviation from the recipe, `format_cost` what the format costs) come before the metrics;
    last, with `record --impact`, the rank and shares of the fix each flagged call's entry names (`impact_rank`,
    `loss_share`, `grad_share`, `weight_share`).
    `path`: a file (written whole or not at all), `-` (stdout), a device or FIFO (`oneiter.outputs`)."""

    rows = [_csv_row(result, i) for i in range(len(result.rows))]
    dest = destination(path, "--csv", stdout_ok=True)
    with open_text(dest, errors="backslashreplace", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["index"])
        writer.writeheader()
        for data in rows:
            for key in ("shape", "shape_target"):
                data[key] = "" if data[key] is None else "x".join(str(s) for s in data[key]) or "scalar"
            writer.writerow(data)


# -- terminal -------------------------------------------------------------------------------------------------------
def rows_to_show(result: CompareResult, *, show_all: bool = False) -> tuple[list[int], str]:
    """Indices of the rows to print and a caption saying what was left out."""
    num = len(result.rows)
    if show_all:
        return list(range(num)), ""
    verdict = result.verdict_obj
    k = verdict.index
    if k is not None:
        start, stop = max(0, k - BEFORE), min(num, k + AFTER + 1)
        hidden = num - (stop - start)
        caption = f"rows {start}-{stop - 1} of {num} around the {verdict.focus}"
        return list(range(start, stop)), caption + (f"; {hidden} more not shown (--all)" if hidden else "")
    measured = {i: r.metrics.rel_l2 for i, r in enumerate(result.rows) if r.metrics is not None}
    top = sorted(sorted(measured, key=lambda i: -measured[i])[:TOP])
    hidden = num - len(top)
    caption = f"the {len(top)} entries with the largest rel_l2"
    caption += f"; {hidden} more not shown (--all)" if hidden else ""
    return top, caption


def _dims(shape: Optional[tuple]) -> str:
    return "-" if shape is None else ("x".join(str(s) for s in shape) or "scalar")


def _pair(ref: str, tgt: str) -> str:
    return ref if ref == tgt else f"{ref}|{tgt}"


def plain_table(caption: str = "") -> Table:
    """The table every terminal report prints: no box, bold headers, the caption (what was left out) below."""
    return Table(caption=caption or None, caption_justify="left", header_style="bold", box=None, pad_edge=False)


def metric_text(value: Optional[float]) -> str:
    """A metric, fixed width; "-" where it was not measured (None, or NaN: a stats-level entry has no elementwise
    numbers)."""
    return sci(value, 9, nan="-")


def _rows_table(result: CompareResult, indices: list[int], caption: str) -> Table:
    """Columns by importance, left to right: a narrow terminal crops the least useful ones. NaN/Inf counts come
    first: the value metrics only see the finite elements."""
    table = plain_table(caption)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("entry", overflow="fold", min_width=16)
    table.add_column("status", no_wrap=True)
    table.add_column("nan/inf", no_wrap=True)
    for name in ("max_abs", "max_rel", "rel_l2", "cosine", "out"):
        table.add_column(name, justify="right", no_wrap=True, min_width=7 if name == "out" else 9)
    if result.local:
        for name in ("local", "noise", "ratio"):
            table.add_column(name, justify="right", no_wrap=True, min_width=9 if name != "ratio" else 6)
    table.add_column("shape", overflow="fold", min_width=5)
    table.add_column("dtype", overflow="fold", min_width=7)
    focus = result.verdict_obj.index
    for i in indices:
        cells = _cells(result.rows[i], i)
        if result.local:
            local = result.local_for(result.rows[i])
            cells[9:9] = ["-"] * 3 if local is None else [metric_text(local.error), metric_text(local.expected),
                                                          f"{local.ratio:5.1f}x" + ("!" if local.flagged else " ")]
        if i == focus:
            cells[0] = f">{i}"  # visible without colour too (pipes, CI logs)
        table.add_row(*(cell(c) for c in cells), style=_style(result, i, focus))
    return table


def _cells(row: Row, index: int) -> list[str]:
    m = row.metrics
    if row.shape is not None and row.shape_target is not None:
        shape = _pair(_dims(row.shape), _dims(row.shape_target))
    else:
        shape = _dims(row.shape or row.shape_target)
    dtype = _pair(row.dtype or "-", row.dtype_target or "-")
    numbers = ["-"] * 5 if m is None else [
        *(metric_text(v) for v in (m.max_abs, m.max_rel, m.rel_l2)),
        "-" if m.cosine != m.cosine else f"{m.cosine:9.6f}", f"{m.frac_out:7.2%}"]
    return [str(index), row.name, row.status, nan_inf_text(m), *numbers, shape, dtype]


def _style(result: CompareResult, index: int, focus: Optional[int]) -> str:
    if index == focus and result.status != "match":
        return "bold red"
    local = result.local_for(result.rows[index]) if result.local else None
    if local is not None and local.flagged:
        return "red"
    return "yellow" if result.rows[index].diverged else ""


_SHOWN_META = ("model", "device", "dtype", "amp", "float8", "num_threads")
_STYLES = {"match": "bold green", "diverged": "bold red", "inconclusive": "bold yellow"}


def _describe(meta: dict) -> str:
    return ", ".join(f"{k} {meta[k]}" for k in _SHOWN_META if meta.get(k) not in (None, ""))


_NOTICE = ("hint:", "NaN/Inf", "warning:")  # details printed in yellow


def print_verdict(console: Console, verdict) -> None:
    """The verdict block every terminal report leads with (one iteration's `Verdict`, two multi-step recordings'
    `StepVerdict`): the headline in its status's colour, then the details, hints and warnings in yellow."""
    console.print(Text(safe_text(verdict.headline), style=_STYLES[verdict.status]))
    for line in verdict.details:
        console.print(Text(safe_text(line), style="yellow" if line.startswith(_NOTICE) else ""))


def print_report(console: Console, result: CompareResult, *, show_all: bool = False) -> None:
    """Verdict, inputs, counts, then the table of the rows that matter."""
    print_verdict(console, result.verdict_obj)
    for label, path, meta in (("reference", result.reference, result.meta_reference),
                              ("target", result.target, result.meta_target)):
        loss = result.loss.get(label)
        loss_text = f", loss {loss:.6e}" if loss is not None else ""
        console.print(Text(safe_text(f"{label:<9} {path} ({_describe(meta)}{loss_text})")))
    counts = ", ".join(f"{n} {status}" for status, n in result.counts().items() if n)
    console.print(Text(f"entries   {len(result.rows)}: {counts}"))
    indices, shown = rows_to_show(result, show_all=show_all)
    if indices:
        print_wide(console, _rows_table(result, indices, shown))
    print_impact(console, result.verdict_obj.impact)
    formats = result.verdict_obj.formats
    if formats:
        print_wide(console, formats_table(formats["calls"], show_all=show_all))


FORMAT_CALLS = 40  # calls of the per-call format table shown without --all


def formats_table(calls: list[dict], *, show_all: bool = False) -> Table:
    """The calls that run a low-precision recipe: what the format costs at each (its output, input gradient and
    weight gradient against the reference) and its worst deviation from the recipe against its accumulation
    noise."""
    shown = calls if show_all else calls[:FORMAT_CALLS]
    hidden = len(calls) - len(shown)
    table = plain_table(f"formats: {len(calls)} calls run a low-precision recipe" +
                        (f"; {hidden} more not shown (--all)" if hidden else ""))
    table.add_column("call", overflow="fold", min_width=16)
    table.add_column("recipe", no_wrap=True)
    for name in ("cost out", "cost grad_in", "cost grad_w", "deviation", "noise"):
        table.add_column(name, justify="right", no_wrap=True, min_width=9)
    table.add_column("ratio", justify="right", no_wrap=True, min_width=6)
    for c in shown:
        name = c["module"] if c["call"] is None else f"{c['module']}@{c['call']}"
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:5.1f}x" + ("!" if c["flagged"] else " ")
        table.add_row(*(cell(x) for x in (name, c["recipe"], *(metric_text(c[k]) for k in (
            "cost_output", "cost_grad_input", "cost_weight", "deviation", "noise")), ratio)),
            style="red" if c["flagged"] else "")
    return table


def print_impact(console: Console, impact) -> None:
    """Which fix matters (`record --impact`): `report/impact_table.py`'s rows, laid out as every terminal table;
    nothing when there is no ranking (one iteration's and several steps' alike)."""
    if impact is None or not impact.fixes:
        return
    table = plain_table(impact_caption(impact))
    for name in HEADERS:
        table.add_column(name, justify="left" if name in ("call fixed", "flagged row") else "right", no_wrap=True)
    for row in impact_cells(impact):
        table.add_row(*(cell(c) for c in row))
    print_wide(console, table)


def print_wide(console: Console, table: Table) -> None:
    """Print a table; into a file or pipe at its natural width instead of squeezing it into 80 columns."""
    if console.is_terminal:
        console.print(table)
        return
    type(console)(file=console.file, width=10_000, highlight=False, color_system=None).print(table)
