"""`oneiter compare --html FILE`: the comparison as one self-contained HTML page, to look at instead of read.

Sits after the engine and `CompareResult.to_json`: its only input is the JSON document (`result.to_json()`), so a
saved `--json` report can be rendered again later. The page holds, top to bottom:

- the verdict banner (green match / red divergence / amber inconclusive): the verdict's headline and details in
  the words of the terminal report (the document's `verdict` rebuilt by `judge.iteration.statement.Verdict.from_dict`);
- with `compare --drill` (the document's `drill`), right under it, the culprit call's ops: their verdict and table
  (`report/op_table.py`), or the `oneiter replay ... --ops` command to run where the target's stack is;
- both runs' metadata and the per-status counts;
- with `record --impact`, the flagged calls ranked by the share of the gap fixing each closes
  (`report/impact_table.py`);
- an error-vs-depth plot (inline SVG drawn here, no JavaScript library): x is the causal position (the `#` of the
  table), y is rel_l2 on a log scale, one colour per phase; one flat dashed line per rtol the rows were held to
  (float32 and bfloat16 rows of a mixed run have two), labelled with their dtypes; exact zeros sit on the `0` band
  at the bottom, NaN/Inf on the band at the top; where the target recorded per-layer local results, the layer's
  own (upstream-free) error is drawn as points and its expected noise as a shaded band, every flagged point gets a
  red ring; the first divergence, the NaN/Inf origin and the culprit are marked, each with its own label;
- the table of the rows around the entry the verdict names, NaN/Inf counts right after the status, both runs'
  dtypes (all rows are in the embedded JSON, `<script type="application/json" id="oneiter-data">`, which a "show
  all" button and any script can read); "divergent only" keeps the flagged rows (`divergent`) and says how many
  there are. The table scrolls sideways in its own box and its cells never wrap, so a narrow window (800 px) keeps
  names and numbers whole (`tools/report_screenshots.py` takes screenshots at 1400 and 800 px).

Nothing is fetched from the network: CSS and the small sorting/filtering script are inline. Every string from the
recording (module names can hold anything) is escaped.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Optional, Union

from oneiter.formatting import json_ready, num, sci
from oneiter.judge.iteration.entries import NOT_DIVERGED, PHASES
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.verdict import Verdict, entry_name
from oneiter.outputs import Destination, destination, write_text
from oneiter.report.impact_table import impact_section
from oneiter.report.op_table import ops_section

__all__ = [
    "write_html", "render_html", "render_svg", "as_document", "verdict_of", "verdict_lines", "table_indices", "num",
    "entry_name", "find_row", "focus_row", "first_divergence", "culprit_row", "PHASE_COLORS", "divergent",
]

PHASE_COLORS = {"forward": "#1f77b4", "backward": "#ff7f0e", "param_grad": "#2ca02c", "optimizer": "#9467bd"}
LOCAL_COLOR, NOISE_COLOR, TOL_COLOR, MARK_COLOR = "#8c564b", "#7f7f7f", "#555555", "#d62728"
TABLE_ROWS, ROWS_BEFORE = 200, 20  # rows in the static table; how many of them precede the first divergence
# (header, key in the row, format); the script renders "show all" rows from the same list
COLUMNS = [
    ("#", "index", "int"), ("entry", "", "entry"), ("status", "status", "text"), ("nan/inf", "nan_inf", "text"),
    ("rel_l2", "rel_l2", "sci"),
    ("max_abs", "max_abs", "sci"), ("cosine", "cosine", "cos"), ("atol", "atol", "sci"), ("rtol", "rtol", "sci"),
]
LOCAL_COLUMNS = [("local rel_l2", "local.rel_l2", "sci"), ("expected", "local.expected", "sci"),
                 ("ratio", "local.ratio", "ratio")]
TAIL_COLUMNS = [("shape", "shape", "shape"), ("dtype", "dtype", "dtype")]
# row statuses that are no divergence: what "divergent only" hides (the engine's list, also in the page's script)
NOT_DIVERGENT = NOT_DIVERGED
Document = dict[str, Any]


# -- reading the JSON document (shared with report.tensorboard) ---------------------------------------------------
def as_document(result: Union[CompareResult, Document]) -> Document:
    """The JSON document of a comparison: `result.to_json()` for a CompareResult, a dict as it is."""
    if isinstance(result, CompareResult):
        return result.to_json()
    if not isinstance(result, dict) or "rows" not in result or "verdict" not in result:
        raise TypeError(f"expected a CompareResult or the dict of CompareResult.to_json, got {type(result).__name__}")
    return result


def find_row(doc: Document, item: Optional[dict]) -> Optional[int]:
    """Index of the row `item` (a verdict, its culprit or first divergence) names: the row with the same module,
    call, phase and tensor, else the item's own `index` (a culprit's tensor handed to a child has another key)."""
    if not item:
        return None
    key = tuple(item.get(k) for k in ("module", "call", "phase", "tensor"))
    found = next((i for i, r in enumerate(doc["rows"]) if (r["module"], r["call"], r["phase"], r["tensor"]) == key),
                 None)
    index = item.get("index")
    if found is None and isinstance(index, int) and 0 <= index < len(doc["rows"]):
        return index
    return found


def verdict_of(doc: Document) -> Verdict:
    """The document's verdict as the typed object the terminal renders (`Verdict.from_dict`)."""
    return Verdict.from_dict(doc["verdict"])


def focus_row(doc: Document) -> Optional[int]:
    """The row the verdict names (the culprit's, or the divergent entry's); None on a match."""
    verdict = verdict_of(doc)
    return find_row(doc, verdict.entry) if verdict.status == "diverged" else None


def first_divergence(doc: Document) -> Optional[int]:
    """The first entry outside tolerance in causal order: not the culprit, which may come much later."""
    return find_row(doc, verdict_of(doc).first_divergence)


def culprit_row(doc: Document, verdict: Verdict) -> Optional[int]:
    """The culprit's row (None: no culprit, or no row of this document is it)."""
    return find_row(doc, verdict.culprit.as_dict()) if verdict.culprit else None


def verdict_lines(doc: Document) -> list[str]:
    """The verdict as sentences (`judge.iteration.verdict.render`, as the terminal prints them): headline, the numbers,
    then hint, NaN/Inf origin, culprit, basis, chain, unprobed calls and the first divergence."""
    verdict = verdict_of(doc)
    return [verdict.title, *([verdict.reason] if verdict.reason else []), *verdict.details]


def table_indices(doc: Document, limit: int = TABLE_ROWS) -> tuple[list[int], str]:
    """Rows of the static table and a note saying which: around the row the verdict names (and the culprit), else
    all rows or the largest rel_l2."""
    num_rows, focus = len(doc["rows"]), focus_row(doc)
    if num_rows <= limit:
        return list(range(num_rows)), f"all {num_rows} rows"
    if focus is None:
        top = sorted(range(num_rows), key=lambda i: -(num(doc["rows"][i].get("rel_l2")) or 0.0))[:limit]
        return sorted(top), f"the {limit} rows with the largest rel_l2 of {num_rows}"
    start = max(0, min(focus - ROWS_BEFORE, num_rows - limit))
    chosen = set(range(start, start + limit))
    verdict = verdict_of(doc)
    what = f"the {verdict.focus or 'divergence'} (#{focus})"
    note = f"{limit} of {num_rows} rows around {what}"
    culprit = culprit_row(doc, verdict)
    if culprit is not None and culprit not in chosen:
        chosen |= set(range(max(0, culprit - 5), min(num_rows, culprit + 6)))
        note = f"{len(chosen)} of {num_rows} rows around {what} and the culprit (#{culprit})"
    return sorted(chosen), note


# -- the plot -------------------------------------------------------------------------------------------------------
def _esc(text: Any) -> str:
    """HTML-escaped text; undecodable bytes of a damaged file (surrogates) shown as escapes."""
    return html.escape(str(text).encode("utf-8", "backslashreplace").decode("utf-8"), quote=True)


class _Axes:
    """Geometry of the error-vs-depth plot: x = causal position, y = log10(value) with a zero and a NaN/Inf band."""

    W, H, LEFT, RIGHT, TOP, BOTTOM = 1300, 440, 64, 16, 24, 46

    def __init__(self, num_rows: int, values: list[float]):
        positive = [v for v in values if v > 0 and math.isfinite(v)] or [1e-6, 1.0]
        self.lo = max(-20, math.floor(math.log10(min(positive))))
        self.hi = max(self.lo + 1, math.ceil(math.log10(max(positive))))
        self.n = max(num_rows, 2)

    def x(self, i: float) -> float:
        return self.LEFT + (self.W - self.LEFT - self.RIGHT) * (i + 0.5) / self.n

    def y(self, v: Optional[float]) -> float:
        """Decades from lo-1 (the zero band) to hi+1 (the NaN/Inf band)."""
        dec: float
        if v is None or not math.isfinite(v):
            dec = self.hi + 1
        elif v <= 0:
            dec = self.lo - 1
        else:
            dec = min(max(math.log10(v), self.lo), self.hi)
        frac = (dec - (self.lo - 1)) / (self.hi - self.lo + 2)
        return self.H - self.BOTTOM - frac * (self.H - self.TOP - self.BOTTOM)


def _grid(ax: _Axes, doc: Document) -> list[str]:
    """Phase bands, decade lines and labels, x ticks, axis titles."""
    out, rows, x0, x1 = [], doc["rows"], ax.LEFT, ax.W - ax.RIGHT
    for phase in PHASES:
        idx = [i for i, r in enumerate(rows) if r["phase"] == phase]
        if idx:
            a, b = ax.x(idx[0] - 0.5), ax.x(idx[-1] + 0.5)
            out.append(f'<rect x="{a:.1f}" y="{ax.TOP}" width="{b - a:.1f}" height="{ax.H - ax.TOP - ax.BOTTOM}" '
                       f'fill="{PHASE_COLORS[phase]}" fill-opacity="0.05"/>'
                       f'<text x="{a + 4:.1f}" y="{ax.TOP + 12}" class="band">{phase}</text>')
    step = 2 if ax.hi - ax.lo > 12 else 1
    labels = [(10.0 ** d, f"1e{d}") for d in range(ax.lo, ax.hi + 1, step)] + [(0.0, "0"), (None, "NaN/Inf")]
    for value, label in labels:
        y = ax.y(value)
        out.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{x0 - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{label}</text>')
    tick = _nice_step(len(rows))
    for i in range(0, len(rows), tick):
        out.append(f'<text x="{ax.x(i):.1f}" y="{ax.H - ax.BOTTOM + 16}" class="tick" text-anchor="middle">{i}</text>')
    out.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{ax.H - 8}" class="axis" text-anchor="middle">causal position '
               '(row #): forward as executed, backward as computed, parameter gradients, updated parameters</text>'
               f'<text transform="translate(14 {ax.H / 2:.0f}) rotate(-90)" class="axis" text-anchor="middle">'
               'rel_l2 (log scale)</text>')
    return out


def _nice_step(n: int) -> int:
    raw = max(1, n // 12)
    base = 10 ** int(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _series(ax: _Axes, points: list[tuple[int, Optional[float], str]], color: str, *, shape: str = "circle",
            dash: str = "") -> list[str]:
    """A line through (row, value, tooltip) points, with one marker per point; zeros/NaN/Inf on their bands."""
    if not points:
        return []
    coords = " ".join(f"{ax.x(i):.1f},{ax.y(v):.1f}" for i, v, _ in points)
    out = [f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.2"'
           f'{f" stroke-dasharray={dash!r}" if dash else ""}/>']
    if len(points) > 5000:  # a very long model: the line alone stays readable and light
        return out
    for i, v, tip in points:
        x, y = ax.x(i), ax.y(v)
        special = v is None or not math.isfinite(v) or v <= 0
        fill = "white" if special else color
        if shape == "diamond":
            mark = (f'<rect x="{x - 2.6:.1f}" y="{y - 2.6:.1f}" width="5.2" height="5.2" '
                    f'transform="rotate(45 {x:.1f} {y:.1f})"', "rect")
        else:
            mark = (f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2"', "circle")
        out.append(f'{mark[0]} fill="{fill}" stroke="{color}"><title>{_esc(tip)}</title></{mark[1]}>')
    return out


def _marker(ax: _Axes, doc: Document, index: int, label: str, element_id: str, *, y_label: float,
            dash: str = "5 3") -> str:
    """A vertical line through row `index`, a ring on its point and a label; `y_label` in pixels."""
    value, x = doc["rows"][index].get("rel_l2"), ax.x(index)
    anchor, dx = ("end", -6) if x > ax.W * 0.6 else ("start", 6)
    ring = ("" if value is None else  # unmeasured (missing, other shape): the line alone
            f'<circle cx="{x:.1f}" cy="{ax.y(num(value)):.1f}" r="7" fill="none" stroke="{MARK_COLOR}" '
            'stroke-width="2"/>')
    return (f'<g id="{element_id}" class="marker"><line x1="{x:.1f}" x2="{x:.1f}" y1="{ax.TOP}" '
            f'y2="{ax.H - ax.BOTTOM}" stroke="{MARK_COLOR}" stroke-dasharray="{dash}"/>{ring}'
            f'<text x="{x + dx:.1f}" y="{y_label:.1f}" text-anchor="{anchor}" class="mark">{_esc(label)}</text></g>')


def _tolerance(ax: _Axes, rows: list[dict]) -> str:
    """One horizontal dashed line per rtol the rows were held to, labelled with how many rows and which dtypes: a
    float32 row next to a bfloat16 one has another rtol, and a line per row would zigzag between the two."""
    groups: dict[float, set] = {}
    for r in rows:
        rtol = num(r.get("rtol"))
        if rtol and rtol > 0:  # rows judged exactly (rtol 0: integers) and unmeasured rows have no line
            groups.setdefault(rtol, set()).add(_dtypes(r))
    out, x0, x1 = [], ax.x(-0.5), ax.x(len(rows) - 0.5)
    for k, (rtol, dtypes) in enumerate(sorted(groups.items())):
        y = ax.y(rtol)
        label = f"rtol {rtol:.1e} ({', '.join(sorted(dtypes))})"
        out.append(f'<g class="tolerance"><line x1="{x0:.1f}" x2="{x1:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="{TOL_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/><text x="{x1 - 4:.1f}" '
                   f'y="{y - 4 - 12 * (k % 2):.1f}" text-anchor="end" class="tick">{_esc(label)}</text></g>')
    return f'<g id="tolerance-line">{"".join(out)}</g>' if out else ""


def _dtypes(row: dict) -> str:
    ref, tgt = row.get("dtype") or "-", row.get("dtype_target") or "-"
    return ref if ref == tgt else f"{ref}|{tgt}"


def _noise_band(ax: _Axes, local: list[tuple[int, dict]]) -> str:
    """The expected noise of the rows with local results as one shaded band from the bottom up to it (a row's local
    error above the band by more than the factor is flagged): a region, not points that look like data. Rows
    without a local result between two that have one keep the level of the one before."""
    levels = [(i, num(loc.get("expected"))) for i, loc in local]
    levels = [(i, v) for i, v in levels if v is not None and v > 0]
    if not levels:
        return ""
    bottom = ax.y(0.0)
    steps = [f"M{ax.x(levels[0][0] - 0.5):.1f} {bottom:.1f}"]
    for k, (i, v) in enumerate(levels):
        end = levels[k + 1][0] - 0.5 if k + 1 < len(levels) else i + 0.5
        steps.append(f"V{ax.y(v):.1f}H{ax.x(end):.1f}")
    steps.append(f"V{bottom:.1f}Z")
    return (f'<path id="noise-band" d="{"".join(steps)}" fill="{NOISE_COLOR}" fill-opacity="0.18" '
            f'stroke="{NOISE_COLOR}" stroke-width="0.8"/>')


def _flagged_marks(ax: _Axes, rows: list[dict], local: list[tuple[int, dict]]) -> list[str]:
    """A red ring on every flagged local point (not only the culprit's)."""
    out = []
    for i, loc in local:
        if loc.get("flagged"):
            value = num(loc.get("rel_l2"))
            out.append(f'<circle class="flagged-mark" cx="{ax.x(i):.1f}" cy="{ax.y(value):.1f}" r="5" fill="none" '
                       f'stroke="{MARK_COLOR}" stroke-width="1.6"><title>#{i} {_esc(entry_name(rows[i]))}: flagged, '
                       f'local rel_l2 {sci(value)} is {num(loc.get("ratio")) or 0:.1f}x its expected noise'
                       f'</title></circle>')
    return out


def render_svg(doc: Document) -> str:
    """The error-vs-depth plot as an inline <svg> element."""
    rows = doc["rows"]
    local = [(i, r["local"]) for i, r in enumerate(rows) if isinstance(r.get("local"), dict)]
    values = [num(r.get(k)) or 0.0 for r in rows for k in ("rel_l2", "rtol")]
    values += [num(loc.get(k)) or 0.0 for _, loc in local for k in ("rel_l2", "expected")]
    ax = _Axes(len(rows), values)
    parts = _grid(ax, doc)
    parts.append(_tolerance(ax, rows))
    if local:
        parts.append(_noise_band(ax, local))
        parts += _series(ax, [(i, num(loc.get("rel_l2")), f"#{i} {entry_name(rows[i])}: local rel_l2 "
                               f"{sci(loc.get('rel_l2'))} ({num(loc.get('ratio')) or 0:.1f}x expected)")
                              for i, loc in local], LOCAL_COLOR, shape="diamond")
    for phase in PHASES:  # rows whose NaN/Inf differ sit on the NaN/Inf band, whatever their finite elements say
        points = [(i, None if _nonfinite_differs(r) else num(r.get("rel_l2")),
                   f"#{i} {entry_name(r)}: {r['status']}, {r.get('nan_inf') or 'rel_l2 ' + sci(r.get('rel_l2'))}")
                  for i, r in enumerate(rows) if r["phase"] == phase and r.get("rel_l2") is not None]
        parts += _series(ax, points, PHASE_COLORS.get(phase, "#000"))
    parts += _flagged_marks(ax, rows, local)
    parts += _markers(ax, doc)
    return (f'<svg id="error-plot" viewBox="0 0 {ax.W} {ax.H}" width="100%" role="img" '
            f'aria-label="rel_l2 per entry along the causal order, log scale">{"".join(parts)}</svg>')


def _markers(ax: _Axes, doc: Document) -> list[str]:
    verdict, out = verdict_of(doc), []
    first = first_divergence(doc)
    if first is not None:
        out.append(_marker(ax, doc, first, f"first divergence #{first}", "first-divergence-marker",
                           y_label=ax.H - ax.BOTTOM - 8))
    nan = find_row(doc, verdict.nan_origin)
    if nan is not None:
        out.append(_marker(ax, doc, nan, f"NaN/Inf origin #{nan}", "nan-origin-marker", y_label=ax.TOP + 44))
    culprit = culprit_row(doc, verdict)
    if culprit is not None:
        name = entry_name(doc["rows"][culprit])
        out.append(_marker(ax, doc, culprit, f"culprit #{culprit}: {name}", "culprit-marker", y_label=ax.TOP + 28,
                           dash="none"))
    return out


# -- the page -------------------------------------------------------------------------------------------------------
_BANNERS = ("match", "diverged", "inconclusive")
KEY_LINES = ("Culprit", "NaN/Inf origin", "  oneiter")  # the details that say where to look, or what to run next


def banner(verdict) -> str:
    """The verdict banner of every page (one iteration's `Verdict`, or two multi-step recordings'
    `StepVerdict`): green match, red divergence, amber inconclusive; its title, reason and details."""
    status = verdict.status if verdict.status in _BANNERS else "diverged"
    reason = f"<p class='reason'>{_esc(verdict.reason)}</p>" if verdict.reason else ""
    details = "".join(f"<p class='{'key' if line.startswith(KEY_LINES) else ''}'>{_esc(line)}</p>"
                      for line in verdict.details)
    return f"<header class='banner {status}' id='verdict'><h1>{_esc(verdict.title)}</h1>{reason}{details}</header>"


def _nonfinite_differs(row: dict) -> bool:
    ref = (row.get("num_nan_ref"), row.get("num_inf_ref"))
    return ref != (row.get("num_nan_target"), row.get("num_inf_target"))


def _value(row: dict, key: str) -> Any:
    head, _, tail = key.partition(".")
    value = row.get(head)
    return (value.get(tail) if isinstance(value, dict) else None) if tail else value


def divergent(row: dict) -> bool:
    """Whether a row is flagged: a divergence of its own (diverged, missing, another shape or dtype), or a local
    error above its expected noise. What the table's "divergent only" box shows."""
    local = row.get("local")
    return row.get("status") not in NOT_DIVERGENT or bool(isinstance(local, dict) and local.get("flagged"))


def _cell(row: dict, key: str, kind: str) -> str:
    value = _value(row, key)
    if kind == "dtype":  # both sides: `float32|bfloat16` where they differ
        ref, tgt = row.get("dtype") or "-", row.get("dtype_target") or "-"
        return f"<td>{_esc(ref if ref == tgt else f'{ref}|{tgt}')}</td>"
    if kind == "entry":
        return f"<td class='entry'>{_esc(entry_name(row))}</td>"
    if kind == "shape":
        return f"<td>{'-' if value is None else _esc('x'.join(map(str, value)) or 'scalar')}</td>"
    if kind in ("text", "int"):
        tip = f" title='{_esc(row['reason'])}'" if key == "status" and row.get("reason") else ""
        return f"<td{tip}>{'-' if value is None else _esc(value)}</td>"
    v = num(value)
    css = "num ratio" if kind == "ratio" else "num"
    shown = "-" if v is None else (f"{v:.6f}" if kind == "cos" else f"{v:.1f}x" if kind == "ratio" else f"{v:.2e}")
    sort = "" if v is None else ("NaN" if math.isnan(v) else "Infinity" if v > 0 and math.isinf(v) else
                                 "-Infinity" if math.isinf(v) else repr(v))
    return f"<td class='{css}' data-v='{sort}'>{shown}</td>"


def _rows_table(doc: Document, columns: list[tuple[str, str, str]]) -> str:
    indices, note = table_indices(doc)
    first, culprit = first_divergence(doc), culprit_row(doc, verdict_of(doc))
    head = "".join(f"<th title='sort'>{_esc(h)}</th>" for h, _, _ in columns)
    body, last = [], None
    for i in indices:
        row = doc["rows"][i]
        if last is not None and i != last + 1:
            body.append(f"<tr class='gap'><td colspan='{len(columns)}'>&#8942; {i - last - 1} rows</td></tr>")
        flagged = isinstance(row.get("local"), dict) and row["local"].get("flagged")
        flags = (("first", i == first), ("culprit", i == culprit), ("flagged", flagged))
        classes = [f"s-{_esc(row['status'])}"] + [name for name, on in flags if on]
        cells = "".join(_cell(row, key, kind) for _, key, kind in columns)
        body.append(f"<tr class='{' '.join(classes)}' data-name='{_esc(entry_name(row))}' "
                    f"data-status='{_esc(row['status'])}' data-divergent='{int(divergent(row))}'>{cells}</tr>")
        last = i
    spec = _esc(json.dumps(columns))
    marks = f"data-first='{'' if first is None else first}' data-culprit='{'' if culprit is None else culprit}'"
    return (f"<p class='note' id='table-note'>Showing {note}; every row is in the embedded data. "
            f"<button id='show-all'>show all {len(doc['rows'])} rows</button></p>"
            f"<div class='scroll'><table id='rows' data-columns='{spec}' {marks}><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _runs(doc: Document) -> str:
    keys = ["model", "device", "dtype", "amp"]
    head = "".join(f"<th>{k}</th>" for k in ["run", "file", *keys, "loss"])
    lines = []
    for label in ("reference", "target"):
        meta = doc.get("meta", {}).get(label, {})
        loss = (doc.get("loss") or {}).get(label)
        cells = [label, doc.get(label), *(meta.get(k) for k in keys), None if num(loss) is None else f"{num(loss):.6e}"]
        lines.append("<tr>" + "".join(f"<td>{_esc(c if c not in (None, '') else '-')}</td>" for c in cells) + "</tr>")
    counts = ", ".join(f"{n} {_esc(s)}" for s, n in doc.get("counts", {}).items() if n)
    return (f"<div class='scroll'><table class='runs'><tr>{head}</tr>{''.join(lines)}</table></div>"
            f"<p>{len(doc['rows'])} entries: {counts}</p>")


def _formats(formats: Optional[dict]) -> str:
    """The calls that run a low-precision recipe (`judge/iteration/recipe_costs.py`): per call its recipe, what the
    format costs at its output, input gradient and weight gradient, and its worst deviation from the recipe against its
    accumulation noise."""
    if not formats:
        return ""
    keys = ("cost_output", "cost_grad_input", "cost_weight", "deviation", "noise")
    head = "".join(f"<th>{h}</th>" for h in ("call", "recipe", "cost output", "cost grad_input", "cost grad_weight",
                                            "deviation", "noise", "ratio"))
    lines = []
    for c in formats.get("calls") or []:
        name = c["module"] if c.get("call") is None else f"{c['module']}@{c['call']}"
        ratio = "-" if num(c.get("ratio")) is None else f"{num(c['ratio']):.1f}x" + ("!" if c.get("flagged") else "")
        cells = [name, c.get("recipe"), *(sci(num(c.get(k))) if num(c.get(k)) is not None else "-" for k in keys),
                 ratio]
        flagged = " class='flagged'" if c.get("flagged") else ""
        lines.append(f"<tr{flagged}>" + "".join(f"<td>{_esc(x)}</td>" for x in cells) + "</tr>")
    return (f"<section><h2>Formats</h2><p>{len(lines)} calls run a low-precision recipe: the format's cost is its "
            f"exact emulation against the reference (never a fault); the deviation is the target's distance from "
            f"that emulation, judged against the accumulation's noise.</p><div class='scroll'><table class='runs'>"
            f"<tr>{head}</tr>{''.join(lines)}</table></div></section>")


def _legend(doc: Document) -> str:
    phases = [p for p in PHASES if any(r["phase"] == p for r in doc["rows"])]
    keys = [f"<span><i style='background:{PHASE_COLORS[p]}'></i>{p}</span>" for p in phases]
    keys.append(f"<span><i class='dash' style='border-color:{TOL_COLOR}'></i>tolerance: one line per rtol "
                f"(rows of another dtype have another)</span>")
    if any(isinstance(r.get("local"), dict) for r in doc["rows"]):
        keys.append(f"<span><i class='diamond' style='background:{LOCAL_COLOR}'></i>local error (layer alone)</span>")
        keys.append(f"<span><i class='band' style='background:{NOISE_COLOR}'></i>expected noise (band up to "
                    f"it)</span>")
        keys.append(f"<span><i class='ring' style='border-color:{MARK_COLOR}'></i>flagged: local error above "
                    f"its noise x factor</span>")
    if verdict_of(doc).status != "match":
        keys.append(f"<span><i class='ring' style='border-color:{MARK_COLOR}'></i>first divergence / culprit</span>")
    keys.append("<span>hollow points: exactly 0 (bottom band) or NaN/Inf (top band)</span>")
    return "<p class='legend'>" + "".join(keys) + "</p>"


def _embedded(doc: Document) -> str:
    """The full document as JSON that cannot end the <script> element early."""
    text = json.dumps(json_ready(doc), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="oneiter-data">{text}</script>'


def render_html(result: Union[CompareResult, Document]) -> str:
    """The whole page as a string."""
    doc = as_document(result)
    verdict = verdict_of(doc)
    status = verdict.status if verdict.status in _BANNERS else "diverged"
    has_local = any(isinstance(r.get("local"), dict) for r in doc["rows"])
    columns = COLUMNS + (LOCAL_COLUMNS if has_local else []) + TAIL_COLUMNS
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>oneiter compare: {status}</title>"
            f"<style>{_CSS}</style></head><body>{banner(verdict)}"
            f"{ops_section(doc.get('drill'))}"
            f"<section><h2>Runs</h2>{_runs(doc)}</section>{impact_section(verdict.impact)}"
            f"<section><h2>Error along the iteration</h2>{render_svg(doc)}{_legend(doc)}</section>"
            f"<section><h2>Entries</h2><p class='controls'><input id='filter' placeholder='filter by name'> "
            f"<label><input type='checkbox' id='divergent-only'> divergent only (<span id='divergent-count'>"
            f"{sum(divergent(r) for r in doc['rows'])}</span> of {len(doc['rows'])} rows flagged)</label></p>"
            f"{_rows_table(doc, columns)}"
            f"</section>{_formats(verdict.formats)}{_embedded(doc)}"
            f"<script>var NOT_DIVERGENT={json.dumps(list(NOT_DIVERGENT))};{_JS}</script>"
            f"</body></html>\n")


def write_html(result_json: Union[CompareResult, Document], path: Union[str, Path, Destination]) -> Path:
    """Write the report page for `result_json` (the dict of `CompareResult.to_json`, or a CompareResult) to `path`:
    a file (whole or not at all), a device, a FIFO or `/dev/stdout` (`oneiter.outputs`)."""
    dest = destination(path, "--html")
    write_text(dest, render_html(result_json))
    return Path(dest.given)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 24px 40px;color:#222}
.banner{margin:0 -24px 12px;padding:14px 24px;color:#fff}.banner p.key{font-weight:bold;font-size:16px}
.banner h1{font-size:20px;margin:0 0 4px;overflow-wrap:anywhere}
.banner p{margin:2px 0}.banner.match{background:#2e7d32}.banner.diverged{background:#c62828}
.banner.inconclusive{background:#a15c00}.banner p{overflow-wrap:anywhere}
h2{font-size:16px;margin:18px 0 6px}table{border-collapse:collapse}td,th{padding:2px 8px;text-align:left}
.runs td,.runs th{border-bottom:1px solid #ddd}#rows{font:12px/1.3 ui-monospace,monospace;width:100%}
#rows th{position:sticky;top:0;background:#eee;cursor:pointer}#rows td.num{text-align:right}
#rows td{white-space:nowrap}.scroll{overflow-x:auto;max-width:100%}#rows tr:nth-child(even){background:#fafafa}
tr.s-diverged td:nth-child(3){color:#c62828}tr.s-match td:nth-child(3){color:#2e7d32}
tr.s-drift td:nth-child(3){color:#a15c00}tr.s-rounding td:nth-child(3){color:#5d7a2e}
#rows td:nth-child(4){color:#c62828;font-weight:bold}
tr.first{outline:2px solid #c62828;font-weight:bold}tr.culprit{background:#fff3c4!important;font-weight:bold}
tr.flagged td.ratio{color:#c62828;font-weight:bold}tr.gap td{color:#888;text-align:center}
svg text{font:11px system-ui,sans-serif}svg .tick{fill:#555}svg .axis{fill:#333;font-size:12px}
svg .band{fill:#777;font-style:italic}svg .grid{stroke:#e4e4e4}svg .mark{fill:#c62828;font-weight:bold;font-size:12px}
.legend span{margin-right:16px;white-space:nowrap}.legend i{display:inline-block;width:14px;height:4px;
margin:0 5px 3px 0;vertical-align:middle}.legend i.dash{height:0;border-top:2px dashed}
.legend i.dot{height:0;border-top:2px dotted}.legend i.band{height:8px;opacity:.35}
.legend i.diamond{width:7px;height:7px;transform:rotate(45deg)}.legend i.ring{width:9px;height:9px;
border:2px solid;border-radius:50%}.note{color:#555}.controls input{margin-right:8px}
"""

_JS = """
(function(){
var data=JSON.parse(document.getElementById('oneiter-data').textContent);
var table=document.getElementById('rows'),cols=JSON.parse(table.dataset.columns),tbody=table.tBodies[0];
var filter=document.getElementById('filter'),only=document.getElementById('divergent-only');
function apply(){var q=filter.value.toLowerCase();for(var tr of tbody.rows){if(!tr.dataset.name)continue;
tr.hidden=(q&&tr.dataset.name.toLowerCase().indexOf(q)<0)||(only.checked&&tr.dataset.divergent!=='1');}}
filter.oninput=apply;only.onchange=apply;
function sortv(td){var v=td.dataset.v;return v===undefined?td.textContent:(v===''?-Infinity:parseFloat(v));}
Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,c){th.onclick=function(){
var dir=th.dataset.dir==='asc'?-1:1;th.dataset.dir=dir>0?'asc':'desc';
var rows=Array.prototype.filter.call(tbody.rows,function(r){return r.dataset.name;});
rows.sort(function(a,b){var x=sortv(a.cells[c]),y=sortv(b.cells[c]);return (x<y?-1:x>y?1:0)*dir;});
tbody.querySelectorAll('tr.gap').forEach(function(g){g.remove();});
rows.forEach(function(r){tbody.appendChild(r);});};});
function num(v){return v===null||v===undefined?null:parseFloat(v==='inf'?'Infinity':v==='-inf'?'-Infinity':v);}
function sci(v){return v.toExponential(2).replace(/e([+-])(\\d)$/,'e$10$2');}
function get(r,k){var p=k.split('.');return p.length>1?(r[p[0]]?r[p[0]][p[1]]:null):r[p[0]];}
function cell(r,k,kind){var td=document.createElement('td'),v=get(r,k);
if(kind==='entry'){td.textContent=r.module+'@'+r.call+' '+r.phase+' '+r.tensor;td.className='entry';}
else if(kind==='shape'){td.textContent=v===null?'-':(v.join('x')||'scalar');}
else if(kind==='dtype'){var a=r.dtype||'-',b=r.dtype_target||'-';td.textContent=a===b?a:a+'|'+b;}
else if(kind==='text'||kind==='int'){td.textContent=v===null||v===undefined?'-':String(v);}
else{var n=num(v);td.className=kind==='ratio'?'num ratio':'num';td.dataset.v=n===null?'':String(n);
td.textContent=n===null?'-':kind==='cos'?n.toFixed(6):kind==='ratio'?n.toFixed(1)+'x':sci(n);}return td;}
document.getElementById('show-all').onclick=function(){tbody.textContent='';
data.rows.forEach(function(r,i){var tr=document.createElement('tr');tr.className='s-'+r.status+
(String(i)===table.dataset.first?' first':'')+(String(i)===table.dataset.culprit?' culprit':'')+
(r.local&&r.local.flagged?' flagged':'');
tr.dataset.name=r.module+'@'+r.call+' '+r.phase+' '+r.tensor;tr.dataset.status=r.status;
tr.dataset.divergent=(NOT_DIVERGENT.indexOf(r.status)<0||(r.local&&r.local.flagged))?'1':'0';
cols.forEach(function(c){tr.appendChild(cell(r,c[1],c[2]));});tbody.appendChild(tr);});
document.getElementById('table-note').textContent='Showing all '+data.rows.length+' rows.';apply();};
})();
"""
