"""The terminal report of a multi-rank comparison (`judge.iteration.ranks.RankedResult`): the overall verdict, one
line per rank, then the full report (`report.terminal.print_report`) of each rank that did not match."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from oneiter.judge.iteration.ranks import RankedResult
from oneiter.judge.iteration.results import CompareResult
from oneiter.report.multistep import print_steps
from oneiter.report.terminal import print_report, safe_text

__all__ = ["print_ranked"]

_STYLES = {"match": "green", "diverged": "red", "inconclusive": "yellow"}


def print_ranked(console: Console, ranked: RankedResult, *, show_all: bool = False) -> None:
    """Overall verdict, one line per rank, then the full report of each rank that did not match (every rank with
    show_all)."""
    overall = ranked.verdict_obj
    console.print(Text(safe_text(overall.headline), style="bold " + _STYLES[overall.status]))
    for rank, result in ranked.results.items():
        console.print(Text(safe_text(f"rank {rank:<3} {result.verdict_obj.headline}"), style=_STYLES[result.status]))
    for kind, line in (("collective", "judged against the exact result of their group's recorded inputs"),
                       ("transfer", "judged against what their sending rank sent")):
        judged = [j for j in ranked.collectives if j.kind == kind]
        flagged = [j for j in judged if j.flagged(ranked.factor)]
        if judged:
            beyond = "beyond their noise" if kind == "collective" else "not what was sent"
            console.print(Text(safe_text(f"{kind}s: {len(judged)} {line}, {len(flagged)} {beyond}"),
                               style="red" if flagged else "green"))
    if overall.note:
        console.print(Text(safe_text(overall.note), style="yellow"))
    for rank, result in ranked.results.items():
        if show_all or result.status != "match":
            title = safe_text(f"-- rank {rank}: {result.reference} vs {result.target} --")
            console.print(Text("\n" + title, style="bold"))
            if isinstance(result, CompareResult):
                print_report(console, result, show_all=show_all)
            else:  # two multi-step recordings of this rank
                print_steps(console, result, show_all=show_all)
