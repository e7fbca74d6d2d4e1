"""Presentation of a comparison of two multi-step recordings (`judge.stepwise.step_compare.StepsResult`): the terminal
table, the CSV and the HTML page with the curves and the band.

Sits after `judge/stepwise/` (which decides; nothing here does) and before the CLI (`cli/compare_cmd.py`). The verdict
is laid out by the one-iteration report's writers: its block (`terminal.print_verdict`: the headline and details, the
step it names and the two commands that record that step in full), the HTML banner (`html.banner`), the CSV's `role`
column and the JSON's `verdict.findings`. Then the terminal report prints one line per step: the loss, gradient
norm and update norm of both runs with their relative difference, the step's error, the band and their ratio
(steps outside the band marked `!`, the named one `>`). The HTML page (the style of `report/html.py`) draws the
three curves of both runs with the band shaded around the reference's, and the error against the band per step on a
log scale.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from rich.console import Console
from rich.text import Text

from oneiter.formatting import rel_diff
from oneiter.judge.stepwise.step_compare import StepRow, StepsResult
from oneiter.outputs import Destination, destination, open_text, write_text
from oneiter.report.html import _CSS, MARK_COLOR, NOISE_COLOR, PHASE_COLORS, _embedded, _esc, banner
from oneiter.report.impact_table import impact_section
from oneiter.report.terminal import metric_text, plain_table, print_impact, print_verdict, print_wide, safe_text

__all__ = ["print_steps", "write_steps_csv", "render_steps_html", "write_steps_html", "MAX_ROWS"]

MAX_ROWS = 40  # steps printed without --all: those around the named step (or the largest errors' on a match)
METRICS = (("loss", "loss"), ("grad_norm", "grad norm"), ("update_norm", "update norm"))


def _shown(result: StepsResult, show_all: bool) -> tuple[list[StepRow], str]:
    rows = result.rows
    if show_all or len(rows) <= MAX_ROWS:
        return rows, ""
    named = result.step
    at = next((i for i, r in enumerate(rows) if r.step == named), None)
    if at is None:  # a match: the steps with the largest error against their band
        keep = sorted(sorted(range(len(rows)), key=lambda i: -(rows[i].ratio or 0.0))[:MAX_ROWS])
    else:
        start = max(0, at - MAX_ROWS // 4)
        keep = list(range(start, min(len(rows), start + MAX_ROWS)))
    return [rows[i] for i in keep], f"{len(keep)} of {len(rows)} steps shown (--all shows every step)"


def print_steps(console: Console, result: StepsResult, *, show_all: bool = False) -> None:
    """Verdict (the one-iteration report's block), the two runs, then the per-step table."""
    print_verdict(console, result.verdict_obj)
    for label, path, meta in (("reference", result.reference, result.meta_reference),
                              ("target", result.target, result.meta_target)):
        said = ", ".join(f"{k} {meta[k]}" for k in ("model", "device", "dtype", "amp", "num_threads")
                         if meta.get(k) not in (None, ""))
        console.print(Text(safe_text(f"{label:<9} {path} ({said})")))
    rows, caption = _shown(result, show_all)
    table = plain_table(caption)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for _, title in METRICS:
        for side in ("ref", "target", "diff"):
            table.add_column(f"{title} {side}" if side != "diff" else "diff", justify="right", no_wrap=True)
    for name in ("error", "band", "ratio"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("of", no_wrap=True)
    for row in rows:
        cells = [f">{row.step}" if row.step == result.step else str(row.step), row.status]
        for name, _ in METRICS:
            ref, tgt = getattr(row, name)
            cells += [metric_text(ref), metric_text(tgt), metric_text(rel_diff(ref, tgt))]
        ratio = row.ratio
        cells += [metric_text(row.error), metric_text(row.band),
                  "-" if ratio is None else f"{ratio:6.2f}x" + ("!" if row.outside else " "), row.by]
        style = "bold red" if row.step == result.step else ("red" if row.outside else "")
        table.add_row(*(Text(safe_text(c)) for c in cells), style=style)
    print_wide(console, table)
    print_impact(console, result.verdict_obj.impact)


def write_steps_csv(result: StepsResult, path: Union[str, Path, Destination]) -> None:
    """One line per step: status, the three metrics of both runs and their difference, error, band, ratio, and its
    role (as one iteration's CSV: `verdict` for the step the verdict names, `first_difference`)."""
    dest = destination(path, "--csv", stdout_ok=True)
    fields = ["step", "status", "bitwise"] + [f"{n}_{s}" for n, _ in METRICS for s in ("reference", "target",
                                                                                         "difference")]
    fields += ["error", "band", "ratio", "of", "nonfinite", "role"]
    with open_text(dest, errors="backslashreplace", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for i, row in enumerate(result.rows):
            data: dict[str, Any] = {"step": row.step, "status": row.status, "bitwise": int(row.bitwise),
                                    "error": row.error, "band": row.band, "ratio": row.ratio, "of": row.by,
                                    "nonfinite": int(row.nonfinite), "role": " ".join(result.verdict_obj.roles(i))}
            for name, _ in METRICS:
                ref, tgt = getattr(row, name)
                data |= {f"{name}_reference": ref, f"{name}_target": tgt, f"{name}_difference": rel_diff(ref, tgt)}
            writer.writerow(data)


# -- the page -------------------------------------------------------------------------------------------------------
REF_COLOR, TGT_COLOR, TWIN_COLOR = PHASE_COLORS["forward"], PHASE_COLORS["backward"], PHASE_COLORS["param_grad"]


class _Plot:
    """A plot of values per step: x the step, y linear (curves) or log10 (errors)."""

    W, H, LEFT, RIGHT, TOP, BOTTOM = 1300, 260, 72, 16, 16, 40

    def __init__(self, steps: list[int], values: list[float], log: bool):
        self.steps, self.log = steps, log
        finite = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)] or [1.0]
        self.lo: float
        self.hi: float
        if log:
            self.lo = max(-20, math.floor(math.log10(min(finite))))
            self.hi = max(self.lo + 1, math.ceil(math.log10(max(finite))))
        else:
            low, high = min(finite), max(finite)
            pad = (high - low) * 0.05 or abs(high) * 0.05 or 1.0
            self.lo, self.hi = low - pad, high + pad

    def x(self, i: float) -> float:
        span = max(len(self.steps) - 1, 1)
        return self.LEFT + (self.W - self.LEFT - self.RIGHT) * i / span

    def y(self, v: Optional[float]) -> float:
        if v is None or not math.isfinite(v):
            frac = 1.0
        elif self.log:
            frac = 0.0 if v <= 0 else (min(max(math.log10(v), self.lo), self.hi) - self.lo) / (self.hi - self.lo)
        else:
            frac = (v - self.lo) / (self.hi - self.lo)
        return self.H - self.BOTTOM - frac * (self.H - self.TOP - self.BOTTOM)

    def grid(self, title: str) -> list[str]:
        out, x0, x1 = [], self.LEFT, self.W - self.RIGHT
        ticks = [10.0 ** d for d in range(int(self.lo), int(self.hi) + 1)] if self.log else \
            [self.lo + (self.hi - self.lo) * k / 4 for k in range(5)]
        for value in ticks:
            y = self.y(value)
            label = f"1e{round(math.log10(value))}" if self.log else f"{value:.4g}"
            out.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                       f'<text x="{x0 - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{label}</text>')
        every = max(1, len(self.steps) // 12)
        for i in range(0, len(self.steps), every):
            out.append(f'<text x="{self.x(i):.1f}" y="{self.H - self.BOTTOM + 16}" class="tick" '
                       f'text-anchor="middle">{self.steps[i]}</text>')
        out.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{self.H - 6}" class="axis" text-anchor="middle">step</text>'
                   f'<text transform="translate(14 {self.H / 2:.0f}) rotate(-90)" class="axis" '
                   f'text-anchor="middle">{_esc(title)}</text>')
        return out

    def line(self, values: Sequence[Optional[float]], color: str, label: str, dash: str = "") -> str:
        coords = " ".join(f"{self.x(i):.1f},{self.y(v):.1f}" for i, v in enumerate(values) if v is not None)
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        marks = "".join(f'<circle cx="{self.x(i):.1f}" cy="{self.y(v):.1f}" r="2" fill="{color}"><title>'
                        f'{_esc(label)}, step {self.steps[i]}: {v:.6g}</title></circle>'
                        for i, v in enumerate(values) if v is not None and math.isfinite(v))
        return f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.4"{dashed}/>{marks}'

    def band(self, low: list[float], high: list[float]) -> str:
        top = " ".join(f"{self.x(i):.1f},{self.y(v):.1f}" for i, v in enumerate(high))
        bottom = " ".join(f"{self.x(i):.1f},{self.y(v):.1f}" for i, v in reversed(list(enumerate(low))))
        return (f'<polygon class="step-band" points="{top} {bottom}" fill="{NOISE_COLOR}" fill-opacity="0.22" '
                f'stroke="none"/>')

    def marker(self, index: int, label: str) -> str:
        x = self.x(index)
        anchor, dx = ("end", -6) if x > self.W * 0.6 else ("start", 6)
        return (f'<g class="marker"><line x1="{x:.1f}" x2="{x:.1f}" y1="{self.TOP}" y2="{self.H - self.BOTTOM}" '
                f'stroke="{MARK_COLOR}" stroke-dasharray="5 3"/><text x="{x + dx:.1f}" y="{self.TOP + 12}" '
                f'text-anchor="{anchor}" class="mark">{_esc(label)}</text></g>')

    def svg(self, parts: list[str], element_id: str, label: str) -> str:
        return (f'<svg id="{element_id}" viewBox="0 0 {self.W} {self.H}" width="100%" role="img" '
                f'aria-label="{_esc(label)}">{"".join(parts)}</svg>')


def _curve(result: StepsResult, name: str, title: str, index: Optional[int]) -> str:
    rows = result.rows
    ref = [getattr(r, name)[0] for r in rows]
    tgt = [getattr(r, name)[1] for r in rows]
    bands = [r.band if r.band is not None and math.isfinite(r.band) else 0.0 for r in rows]
    low = [v - abs(v) * b for v, b in zip(ref, bands, strict=True)]
    high = [v + abs(v) * b for v, b in zip(ref, bands, strict=True)]
    twin = [None if r.twin is None else r.twin[[m for m, _ in METRICS].index(name)] for r in rows]
    plot = _Plot([r.step for r in rows], [*ref, *tgt, *low, *high], log=False)
    parts = plot.grid(title) + [plot.band(low, high), plot.line(ref, REF_COLOR, f"reference {title}"),
                                plot.line(tgt, TGT_COLOR, f"target {title}")]
    if any(v is not None for v in twin):
        parts.append(plot.line(twin, TWIN_COLOR, f"twin {title}", dash="4 3"))
    if index is not None:
        parts.append(plot.marker(index, f"step {rows[index].step}"))
    return plot.svg(parts, f"curve-{name}", f"{title} per step, both runs, the band shaded")


def _errors(result: StepsResult, index: Optional[int]) -> str:
    rows = result.rows
    errors = [r.error for r in rows]
    bands = [r.band for r in rows]
    plot = _Plot([r.step for r in rows], [*errors, *(b for b in bands if b)], log=True)
    parts = plot.grid("error vs band (log)")
    parts.append(plot.line([b if b else None for b in bands], NOISE_COLOR, "band", dash="6 4"))
    parts.append(plot.line(errors, TGT_COLOR, "error (target vs reference)"))
    for i, row in enumerate(rows):
        if row.outside:
            parts.append(f'<circle class="flagged-mark" cx="{plot.x(i):.1f}" cy="{plot.y(row.error):.1f}" r="5" '
                         f'fill="none" stroke="{MARK_COLOR}" stroke-width="1.6"><title>step {row.step}: outside the '
                         f'band</title></circle>')
    if index is not None:
        parts.append(plot.marker(index, f"first step outside: {rows[index].step}"))
    return plot.svg(parts, "error-plot", "each step's error and the band, log scale")


def render_steps_html(result: StepsResult) -> str:
    verdict = result.verdict_obj
    index = verdict.index
    runs = "".join(f"<tr><td>{label}</td><td>{_esc(path)}</td>" + "".join(
        f"<td>{_esc(meta.get(k, '-'))}</td>" for k in ("model", "device", "dtype", "amp")) + "</tr>"
        for label, path, meta in (("reference", result.reference, result.meta_reference),
                                  ("target", result.target, result.meta_target)))
    legend = (f"<p class='legend'><span><i style='background:{REF_COLOR}'></i>reference</span>"
              f"<span><i style='background:{TGT_COLOR}'></i>target</span>"
              f"<span><i class='dash' style='border-color:{TWIN_COLOR}'></i>twin (the target perturbed by one "
              f"rounding per step)</span><span><i class='band' style='background:{NOISE_COLOR}'></i>band: what the "
              f"precision explains ({verdict.factor:g}x the twin's drift), around the reference</span>"
              f"<span><i class='ring' style='border-color:{MARK_COLOR}'></i>outside the band</span></p>")
    curves = "".join(f"<h3>{title}</h3>{_curve(result, name, title, index)}" for name, title in METRICS)
    head = "".join(f"<th>{h}</th>" for h in ("step", "status", "loss ref", "loss target", "grad norm ref",
                                             "grad norm target", "update norm ref", "update norm target", "error",
                                             "band", "ratio"))
    body = "".join(
        f"<tr class='{'first' if r.step == result.step else ''}'><td>{r.step}</td><td>{_esc(r.status)}</td>"
        + "".join(f"<td class='num'>{metric_text(v)}</td>" for n, _ in METRICS for v in getattr(r, n))
        + f"<td class='num'>{metric_text(r.error)}</td><td class='num'>{metric_text(r.band)}</td>"
        f"<td class='num'>{'-' if r.ratio is None else f'{r.ratio:.2f}x'}</td></tr>" for r in result.rows)
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>oneiter compare (steps): "
            f"{verdict.status}</title><style>{_CSS}</style></head><body>{banner(verdict)}<section><h2>Runs</h2>"
            f"<div class='scroll'><table class='runs'><tr><th>run</th><th>file</th><th>model</th><th>device</th>"
            f"<th>dtype</th><th>amp</th></tr>{runs}</table></div></section>{impact_section(verdict.impact)}"
            f"<section><h2>Curves</h2>{legend}{curves}</section>"
            f"<section><h2>Error per step</h2>{_errors(result, index)}</section>"
            f"<section><h2>Steps</h2><div class='scroll'><table id='rows'><thead><tr>{head}</tr></thead><tbody>"
            f"{body}</tbody></table></div></section>"
            f"{_embedded(result.as_dict())}</body></html>\n")


def write_steps_html(result: StepsResult, path: Union[str, Path, Destination]) -> Path:
    """Write the page (`oneiter.outputs`: a file whole or not at all, a device, a FIFO or /dev/stdout)."""
    dest = destination(path, "--html")
    write_text(dest, render_steps_html(result))
    return Path(dest.given)
