"""Which names an optimizer keeps its per-parameter state under, and how a replay maps the reference's onto the
target's.

A replay loads the reference's recorded optimizer state into the target's optimizer (`optimizer_start.py`). Torch's
Adam and AdamW keep `step`, `exp_avg`, `exp_avg_sq` (`max_exp_avg_sq` with amsgrad) per parameter; a vendor's or
apex's fused Adam may keep the same quantities elsewhere (apex's `FusedAdam`: the step count in the param group,
`group['step']`) or under other names (a vendor Adam storing `m` and `v`). Loaded as they are, the user's own
`step()` then fails inside the optimizer (`KeyError: 'm'`) or, worse, runs from a step count of its own.

`KNOWN` is the table of classes known to hold Adam's quantities, and where: canonical quantity (torch's name) ->
the key of the per-parameter state, or `group:<key>` for a value kept in the parameter's group. `plan` maps the
reference's state onto the target's where both classes are in it (or the target's class keeps exactly the
reference's names); otherwise it refuses in one line naming both classes and both sets of names, before the user's
step runs. A class not in the table shows its names by a trial step of a copy of it over one small parameter with a
zero gradient (`discover`); a vendor adds its class as one row of `KNOWN`.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Optional

from oneiter.errors import OneIterError

__all__ = ["KNOWN", "GROUP", "qualified", "discover", "plan", "renamed"]

GROUP = "group:"
_TORCH = {"step": "step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq"}
KNOWN: dict[str, dict[str, str]] = {
    "torch.optim.adam.Adam": _TORCH,
    "torch.optim.adamw.AdamW": _TORCH,
    # apex's FusedAdam (its fused_adam module): "assume same step across group", moments per parameter
    "apex.optimizers.fused_adam.FusedAdam": {"step": GROUP + "step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
_RENAMED: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()


def qualified(opt) -> str:
    """`torch.optim.adamw.AdamW`: the class of an optimizer as `KNOWN` names it."""
    kind = type(opt)
    return f"{kind.__module__}.{kind.__qualname__}"


def renamed(opt) -> dict[str, str]:
    """target key -> reference key of the state a replay loaded into `opt` under other names or in its param groups
    (`group:<key>`); {}: the same names."""
    return dict(_RENAMED.get(opt, {}))


def discover(opt) -> Optional[set[str]]:
    """The per-parameter state keys `opt`'s class makes at its first step (and `group:<key>` for what it adds to the
    param group), from a trial step of a copy of it (its instance attributes deep-copied, no hooks, empty state, plain
    kernels) over a zero-gradient copy of its smallest parameter; None when that fails (nothing is known then)."""
    import copy

    import torch

    params = [(p, g) for g in opt.param_groups for p in g["params"]]
    if not params:
        return None
    p, group = min(params, key=lambda pg: pg[0].numel())
    trial = object.__new__(type(opt))
    try:  # deep copies: the trial never touches the user's optimizer (a vendor's buffers, its master weights)
        for key, value in vars(opt).items():
            if key in ("param_groups", "state") or callable(value):
                continue
            setattr(trial, key, collections.OrderedDict() if key.endswith("_hooks") else copy.deepcopy(value))
    except Exception:  # noqa: BLE001 - an attribute that cannot be copied: nothing is known
        return None
    q = torch.zeros_like(p.detach()).requires_grad_(p.requires_grad)
    q.grad = torch.zeros_like(q)
    options = {k: v for k, v in group.items() if k != "params"}
    options.update({k: False for k in ("foreach", "fused", "capturable") if options.get(k)})
    trial.param_groups, trial.state = [{**options, "params": [q]}], collections.defaultdict(dict)
    try:
        with torch.no_grad():
            trial.step()
    except Exception:  # noqa: BLE001 - the user's optimizer refusing a trial is no error of the replay
        return None
    return set(trial.state[q]) | {GROUP + k for k in trial.param_groups[0] if k not in group}


def plan(opt, ref_class: str, ref_keys: set[str]) -> dict[str, str]:
    """reference key -> where the target's optimizer keeps that quantity (its state key, or `group:<key>`); raises
    OneIterError (one line, both classes and both sets of names) where no such map is known."""
    mine = qualified(opt)
    if ref_class == mine:
        return {k: k for k in ref_keys}
    theirs, ours = KNOWN.get(ref_class), KNOWN.get(mine)
    if theirs is not None and ours is not None:
        quantity = {where: q for q, where in theirs.items()}
        found = {k: ours.get(quantity.get(k, ""), "") for k in ref_keys}
        if all(found.values()):
            return found
    keys = discover(opt) if ours is None else {k for k in ours.values() if not k.startswith(GROUP)}
    if keys is None or keys == ref_keys:  # unknown (its trial failed: loaded as recorded), or the same names
        return {k: k for k in ref_keys}
    theirs_shown = ref_class.rpartition(".")[2] or "optimizer (its class not recorded)"
    raise OneIterError(
        f"the target's optimizer {type(opt).__qualname__} keeps its state as {{{', '.join(sorted(keys))}}}, the "
        f"reference's {theirs_shown} as {{{', '.join(sorted(ref_keys))}}}: a replay cannot load one into the other, "
        f"and oneiter maps only classes known to hold the same quantities ({', '.join(KNOWN)}; a vendor's class is "
        f"one row of KNOWN in oneiter/record/start/state_names.py)", param="optimizer")


def remember(opt, mapping: dict[str, str]) -> None:
    """Keep `opt`'s renamed per-parameter keys (target key -> reference key) for `renamed`."""
    moved = {where: key for key, where in mapping.items() if where != key}
    if moved:
        _RENAMED[opt] = moved
