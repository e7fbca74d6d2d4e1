"""Which fix matters (`record --impact`): the ranking as the terminal, the HTML page and the CSV show it.

Sits after the verdict (`judge/iteration/impact.py` ranks, `verdict.py` says which fix matters most), before the
terminal report (`terminal.py` lays these cells out) and the page (`html.py`): one row per flagged call fixed,
largest share first — its own error, the share of the loss gap, the gradients' and the updated
weights' gaps fixing it closes, and the gaps left — then the run with nothing fixed, the one with nothing fixed and
its weights perturbed by one rounding (how far a rounding moves each gap) and the one with all fixed (what the
precision alone leaves). Nothing is decided here. The CSV marks the entry each fix is named by (`csv_columns`).
"""

from __future__ import annotations

import html
from typing import Any, Optional

from oneiter.format.schema import ROOT_MODULE, split_call_key, split_child_tensor
from oneiter.formatting import num, sci
from oneiter.judge.iteration.impact import Fix, Impact

__all__ = ["HEADERS", "impact_cells", "caption", "impact_section", "CSV_IMPACT", "csv_columns"]

HEADERS = ("rank", "call fixed", "flagged row", "own rel_l2", "ratio", "loss share", "grad share", "weight share",
           "loss gap", "grad gap", "weight gap")
CSV_IMPACT = ("impact_rank", "loss_share", "grad_share", "weight_share")  # the CSV's columns of the ranking


def _pct(value: Any) -> str:
    v = num(value)
    return "-" if v is None or v != v else f"{100 * v:.1f}%"


def impact_cells(impact: Impact) -> list[list[str]]:
    """The table's rows as text: each fix in rank order, then `nothing fixed` and `all fixed`."""
    rows = []
    for rank, fix in enumerate(impact.fixes, start=1):
        shares = [_pct(fix.share), _pct(fix.grad_share), _pct(fix.weight_share)] if fix.measured else \
            [(fix.note or "not measured").split(" (")[0].split(": the ")[0], "", ""]  # why in short: the verdict's
        rows.append([str(rank), fix.name, f"{fix.phase} {fix.tensor}", sci(fix.rel_l2), f"{fix.ratio:.1f}x",
                     *shares, *(sci(v, nan="-") for v in (fix.loss_gap, fix.grad_gap, fix.weight_gap))])
    plain = impact.plain
    rows.append(["", "nothing fixed", "", "", "", "", "", "",
                 *(sci(plain.get(k), nan="-") for k in ("loss_gap", "grad_gap", "weight_gap"))])
    moved = impact.perturbed
    if moved is not None:  # what one rounding of the weights does to each gap: the shares' resolution
        rows.append(["", "one rounding", "nothing fixed", "", "",
                     *(_pct(moved.get(k)) for k in ("share", "grad_share", "weight_share")),
                     *(sci(moved.get(k), nan="-") for k in ("loss_gap", "grad_gap", "weight_gap"))])
    every = impact.every
    if every is not None and len(impact.fixes) > 1:
        rows.append(["", f"all {len(impact.fixes)} fixed", "", "", "",
                     *(_pct(every.get(k)) for k in ("share", "grad_share", "weight_share")),
                     *(sci(every.get(k), nan="-") for k in ("loss_gap", "grad_gap", "weight_gap"))])
    return rows


def caption(impact: Impact) -> str:
    measure = "the loss gap" if impact.by_loss else "the gradients' gap (the loss is the reference's bit for bit)"
    if impact.step is not None:
        return (f"which fix matters: each flagged call fixed alone at every step (float64 on the trusted path), "
                f"ranked by the share of the loss gap at step {impact.step} it closes (a multi-step reference keeps "
                f"statistics of its gradients and weights: only the loss is compared)")
    return (f"which fix matters: each flagged call fixed alone (float64 on the trusted path), ranked by the share of "
            f"{measure} it closes; gaps are what is left to the reference")


def impact_section(impact: Optional[Impact]) -> str:
    """The HTML page's section ("" when there is no ranking)."""
    if impact is None or not impact.fixes:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c, quote=True)}</td>" for c in row) + "</tr>"
                   for row in impact_cells(impact))
    return (f"<section id='impact'><h2>Which fix matters</h2><p class='note'>{html.escape(caption(impact))}</p>"
            f"<div class='scroll'><table class='runs'><tr>{head}</tr>{body}</table></div></section>")


def _row_key(fix: Fix) -> tuple[str, int, str, str]:
    """The entry a fix is named by, as the rows key it (a tensor handed to a child is that child's row)."""
    child = split_child_tensor(fix.tensor)
    if child is None:
        return (fix.module, fix.call, fix.phase, fix.tensor)
    module, call = split_call_key(child[0])
    return (module or ROOT_MODULE, call, fix.phase, child[1])


def csv_columns(impact: Optional[Impact]) -> dict[tuple[str, int, str, str], dict[str, Any]]:
    """Row key -> the CSV's impact columns for the entry each fix is named by (every other row leaves them empty)."""
    if impact is None:
        return {}
    return {_row_key(f): {"impact_rank": rank, "loss_share": f.share, "grad_share": f.grad_share,
                          "weight_share": f.weight_share}
            for rank, f in enumerate(impact.fixes, start=1) if f.measured}
