"""What the low-precision recipes of a target cost, and how closely it follows them: the verdict's `formats`.

Sits beside the verdict (`verdict.py` calls `summary` once, and renders its `lines`): blame judged every call that
runs a recipe against the recipe's exact emulation (`blame._judge_recipe`; the rows come from
`record/local/recipe_rows.py`). This module only gathers those results: per recipe its calls, the format's own cost
(the emulation against the reference: never a fault), per call the costs of its output, input gradient and weight
gradient and its worst deviation against the accumulation's noise; the reports lay the per-call table out
(`report/terminal.py`, `report/html.py`).
"""

from __future__ import annotations

from typing import Any, Optional

from oneiter.formatting import num, sci
from oneiter.judge.iteration.entries import LocalResult

__all__ = ["summary", "lines", "recipe_error", "COST_ROLES"]

COST_ROLES = (("forward", "output", "cost_output"), ("backward", "grad_input.0", "cost_grad_input"),
              ("param_grad", "weight", "cost_weight"))
"""(phase, tensor, key): the rows whose format cost each call of the per-call table shows."""


def recipe_error(recipe: Any, deviation: Any, ratio: Any, expected: Any, format_cost: Any) -> str:
    """Why a call that runs a recipe is blamed: its deviation from the recipe against the accumulation's noise,
    and what the format itself costs there (which is not blamed)."""
    return (f"its deviation from its recipe ({recipe}) rel_l2 {sci(deviation)}, on the reference's inputs, is "
            f"{num(ratio) or 0:.1f}x its accumulation noise {sci(expected)} (the format itself costs "
            f"{sci(format_cost)} there, which is not a fault)")


def _entry(r: LocalResult) -> dict[str, Any]:
    return r.key._asdict()


def _name(e: dict) -> str:
    return f"{e['module']}@{e['call']} {e['phase']} {e['tensor']}"


def _calls(rows: list[LocalResult]) -> list[dict[str, Any]]:
    """One entry per call (in causal order of its first row): its recipe, the format's cost per role, and its worst
    deviation against its noise."""
    calls: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        module, call = (r.module, r.call) if r.phase in ("forward", "backward") else (r.module, None)
        item = calls.setdefault((module, call if call is not None else -1), {
            "module": module, "call": call, "recipe": r.recipe, "cost_output": None, "cost_grad_input": None,
            "cost_weight": None, "deviation": None, "noise": None, "ratio": None, "flagged": False})
        for phase, tensor, key in COST_ROLES:
            if (r.phase, r.tensor) == (phase, tensor):
                item[key] = r.format_cost
        if item["ratio"] is None or r.ratio > item["ratio"]:
            item.update(deviation=r.error, noise=r.expected, ratio=r.ratio)
        item["flagged"] = item["flagged"] or r.flagged
    return _with_weights(list(calls.values()))


def _with_weights(calls: list[dict]) -> list[dict]:
    """A parameter's gradient row (call None) folded into its module's single call; kept apart when the module ran
    more than once (a shared weight's gradient is every call's)."""
    by_module: dict[str, list[dict]] = {}
    for c in calls:
        by_module.setdefault(c["module"], []).append(c)
    kept = []
    for c in calls:
        mine = by_module[c["module"]]
        callers = [m for m in mine if m["call"] is not None]
        if c["call"] is None and len(callers) == 1:
            target = callers[0]
            target["cost_weight"] = c["cost_weight"]
            if c["ratio"] is not None and (target["ratio"] is None or c["ratio"] > target["ratio"]):
                target.update(deviation=c["deviation"], noise=c["noise"], ratio=c["ratio"])
            target["flagged"] = target["flagged"] or c["flagged"]
            continue
        kept.append(c)
    return kept


def summary(local: list[LocalResult]) -> Optional[dict[str, Any]]:
    """The target's recipes, their cost and how closely it follows them (module docstring); None: no recipe ran."""
    rows = [r for r in local if r.recipe]
    if not rows:
        return None
    recipes: dict[str, dict[str, Any]] = {}
    for r in rows:
        item = recipes.setdefault(r.recipe, {"recipe": r.recipe, "calls": set(), "num_tensors": 0, "num_flagged": 0})
        if r.phase in ("forward", "backward"):
            item["calls"].add((r.module, r.call))
        item["num_tensors"] += 1
        item["num_flagged"] += int(r.flagged)
    outputs = [r for r in rows if (r.phase, r.tensor) == ("forward", "output")] or rows
    costly = max(rows, key=lambda r: num(r.format_cost) or 0.0)
    worst = max(rows, key=lambda r: r.ratio)
    flagged = next((r for r in rows if r.flagged), None)
    return {
        "recipes": [{**{k: v for k, v in item.items() if k != "calls"}, "num_calls": len(item["calls"])}
                    for item in recipes.values()],
        "first": {**_entry(outputs[0]), "format_cost": outputs[0].format_cost},
        "largest_cost": {**_entry(costly), "format_cost": costly.format_cost},
        "worst": {**_entry(worst), "ratio": worst.ratio, "deviation": worst.error, "expected": worst.expected},
        "first_flagged": None if flagged is None else {**_entry(flagged), "ratio": flagged.ratio},
        "factor": rows[0].factor,
        "calls": _calls(rows),
    }


def lines(formats: Optional[dict]) -> list[str]:
    """The verdict's lines about the formats: what they cost, and whether the target follows its recipes."""
    if not formats:
        return []
    names = ", ".join(f"{r['recipe']} ({r['num_calls']} calls)" for r in formats["recipes"])
    first, costly = formats["first"], formats["largest_cost"]
    text = (f"format: the target runs {names}; the format costs {sci(first['format_cost'])} at the first "
            f"({_name(first)})")
    if _name(costly) != _name(first):
        text += f", up to {sci(costly['format_cost'])} ({_name(costly)})"
    flagged = sum(r["num_flagged"] for r in formats["recipes"])
    if formats.get("first_flagged"):
        text += (f"; {flagged} of its tensors deviate from the recipe beyond {num(formats['factor']) or 4:g}x their "
                 f"accumulation noise (the first: {_name(formats['first_flagged'])}, "
                 f"{num(formats['first_flagged']['ratio']) or 0:.1f}x)")
    else:
        text += (f"; the target follows the recipe within {num(formats['worst']['ratio']) or 0:.1f}x its "
                 f"accumulation noise")
    return [text]
