"""Presentation of `replay --ops` (`judge.replayed.op_verdict.OpsResult`) and of `compare --drill`: terminal table and
HTML section.

Nothing here decides anything: the verdict and its sentences are the result's (`OpsResult.lines`); the terminal
shows them, then a table of the ops (op, phase, input shapes and dtypes, strides, own error, expected noise, ratio;
the culprit's line is in the sentences above it, every op's in the JSON): every op that computes when there are
few, else the ops around the culprit and every flagged one, or the highest ratios on a match. The HTML section
(`ops_section`) renders the same rows from the JSON document (`OpsResult.as_dict`), for the compare report's page,
under its culprit. Text from files and models (op lines, module names) is escaped.
"""

from __future__ import annotations

import html
from typing import Any

from oneiter.formatting import sci
from oneiter.report.terminal import cell, plain_table, safe_text

__all__ = ["print_ops", "rows_shown", "ops_section", "print_drill", "ALL_ROWS", "AROUND", "TOP"]

ALL_ROWS, AROUND, TOP = 40, 6, 12  # every computing row up to this many; else +-AROUND the culprit, or the TOP ratios
COLUMNS = ("#", "op", "phase", "inputs", "strides", "own rel_l2", "expected", "ratio")
_NUMERIC = ("#", "own rel_l2", "expected", "ratio")


def rows_shown(doc: dict[str, Any]) -> tuple[list[dict], str]:
    """The rows of the table (from the JSON document) and a note saying which they are."""
    rows = [r for r in doc["ops"] if r["computes"] or r["flagged"]]
    if len(rows) <= ALL_ROWS:
        return rows, ""
    culprit = doc.get("culprit")
    if culprit is not None:
        at = next(i for i, r in enumerate(rows) if r["index"] == culprit["index"])
        chosen = {i for i in range(max(0, at - AROUND), min(len(rows), at + AROUND + 1))}
        chosen |= {i for i, r in enumerate(rows) if r["flagged"]}
        what = f"the {len(chosen)} ops around the culprit and every flagged one"
    else:
        ranked = sorted(range(len(rows)), key=lambda i: -(rows[i]["ratio"] or 0.0))
        chosen = set(ranked[:TOP])
        what = f"the {len(chosen)} ops with the highest ratios"
    return [rows[i] for i in sorted(chosen)], f"showing {what} of {len(rows)} that compute; --json has every op"


def _cells(row: dict) -> tuple:
    """A row's cells: inputs as `shape dtype` (bf16 for bfloat16, f32 for float32, ...), strides per input."""
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x" + ("!" if row["flagged"] else "")
    error = sci(row["rel_l2"]) if not row["mismatch"] else f"{row['mismatch']} NaN/Inf"
    inputs = " ".join(f"{'x'.join(map(str, s)) or '()'} {_short_dtype(d)}" for s, d in zip(row["shapes"], row["dtypes"],
                                                                                         strict=True))
    strides = " ".join(f"({','.join(map(str, s))})" for s in row["strides"])
    note = f" [{row['note']}]" if row["note"] and row["rel_l2"] is None else ""
    return str(row["index"]), row["op"] + note, row["phase"], inputs, strides, error, sci(row["noise"]), ratio


def _short_dtype(name: str) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}.get(name, name)


def print_ops(console, doc: dict[str, Any]) -> None:
    """Verdict first (the result's own lines), then the table of ops, from the JSON document."""
    for i, line in enumerate([doc["headline"], *doc["details"]]):
        style = ("bold red" if doc["exit_code"] else "bold green") if i == 0 else ""
        console.print(cell(line), style=style)
    rows, note = rows_shown(doc)
    if rows:
        table = plain_table()
        for name in COLUMNS:
            table.add_column(name, justify="right" if name in _NUMERIC else "left",
                             overflow="fold", no_wrap=name not in ("inputs", "strides"))
        for row in rows:
            table.add_row(*(cell(x) for x in _cells(row)), style="bold red" if row["flagged"] else "")
        console.print(table)
    if note:
        console.print(note, markup=False)
    for path in doc.get("repro") or ():
        console.print(f"wrote {safe_text(path)}", markup=False)


def print_drill(console, drill: dict[str, Any]) -> None:
    """`compare --drill`: the op report of the culprit's call, or the command that makes it where its stack is."""
    if drill["ops"] is not None:
        console.print(cell(f"drill: the ops of {drill['layer']}@{drill['call']} on this machine's stack"))
        print_ops(console, drill["ops"])
        return
    console.print(cell(f"drill: not run here ({drill['why_not']}); on the target's machine run:"))
    console.print(cell(f"  {drill['command']}"))


# -- HTML -------------------------------------------------------------------------------------------------------------
def _esc(text: Any) -> str:
    return html.escape(safe_text(text), quote=True)


def ops_section(drill: dict[str, Any] | None) -> str:
    """The compare page's section on the culprit's ops (`compare --drill`); empty without a drill."""
    if not drill:
        return ""
    head = f"<section id='ops'><h2>Inside the culprit: the ops of {_esc(drill['layer'])}@{drill['call']}</h2>"
    doc = drill["ops"]
    if doc is None:
        return (f"{head}<p>Not run here ({_esc(drill['why_not'])}). On the target's machine: "
                f"<code>{_esc(drill['command'])}</code></p></section>")
    lines = "".join(f"<p>{_esc(line)}</p>" for line in [doc["headline"], *doc["details"]])
    rows, note = rows_shown(doc)
    header = "".join(f"<th>{_esc(name)}</th>" for name in COLUMNS)
    body = "".join(
        f"<tr class='{'culprit' if row['flagged'] else ''}'>" + "".join(f"<td>{_esc(x)}</td>" for x in _cells(row))
        + "</tr>" for row in rows)
    note_html = f"<p>{_esc(note)}</p>" if note else ""
    return (f"{head}{lines}<div class='scroll'><table id='op-rows'><tr>{header}</tr>{body}</table></div>{note_html}"
            f"</section>")
