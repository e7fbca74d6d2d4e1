"""The optimizer rows of a teacher-forced replay: each parameter's update judged on its own.

A faithful copy of the target's optimizer (`faithful_copy`: its class, instance attributes, group options and
state; never rebuilt from its param groups) is made over fresh tensors holding the reference's weights and
gradients and stepped once (`shadow_step`); its update (after - before) is judged against the reference's
(state_after - state_before; for a parameter the model wrote itself before the step, such as the rows
nn.Embedding(max_norm) renormalises in forward, `before` is where the step found it: `/step_start`). The state is
the one the target's optimizer holds — a replay loaded the reference's (`record/start/optimizer_start.py`) — cast
for each shadow parameter as `load_state_dict` would; the float64 and the reference-precision steps of the noise
start from the reference's own recorded state.
A copy of every weight, gradient and optimizer state at once would double a large model's memory, so torch's
per-parameter optimizers (`PER_PARAMETER`: each parameter updated from its own gradient and state only) are
stepped in chunks of about `STEP_BYTES` of parameters (`step_chunks`), each freed before the next; any other
optimizer (a subclass, LBFGS, the user's own: its step may couple parameters) steps once over all.
When a row's error is above roundoff, its noise is measured like any call's: the same shadow step in float64,
in the target's and in the reference's precision, on the CPU.
"""

from __future__ import annotations

import collections
import functools
import math
import types
from typing import Callable

import torch
import torch.optim

from oneiter.format.schema import (
    OPTIMIZER,
    PARAM_GRADS,
    PLACEMENTS,
    STATE_AFTER,
    STATE_BEFORE,
    STEP_GRADS,
    group_path,
    optimizer_entry,
)
from oneiter.record.local.fidelity import digest, exact_tensor
from oneiter.record.local.rerun import ProbeSkip, Rerunner, Site, rel_l2, tensor_stats
from oneiter.record.local.rows import LATE, JudgedRow, dtype_name, first_line, leaf, owner
from oneiter.record.modes import trusted
from oneiter.record.start.state_names import renamed
from oneiter.runtime.names import parameters
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.sharding import shard_of

__all__ = ["PER_PARAMETER", "STEP_BYTES", "step_chunks", "shadow_step", "faithful_copy", "optimizer_rows",
           "check_updates", "step_grad_path"]

# torch's optimizers whose step updates each parameter from its own gradient and state only: a copy of one over a
# few of the parameters steps them exactly as over all of them (single-tensor, foreach and fused alike)
PER_PARAMETER: frozenset[str] = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                                           "RAdam", "RMSprop", "Rprop"})
STEP_BYTES = 64 << 20  # parameters per shadow step of such an optimizer (read when the rows are made)

_CPU = torch.device("cpu")
_SITES = {  # where the shadow step runs: the target's own (judged), and the three of its noise
    "target": lambda device: Site("target", device, live=True, cast="live", autocast=None, params="reference",
                                  trusted=False),
    "high": lambda _: Site("high", _CPU, live=False, cast="float64", autocast=None, params="reference", trusted=True),
    "low": lambda _: Site("low", _CPU, live=False, cast="live", autocast=None, params="reference", trusted=True),
    "reference": lambda _: Site("reference", _CPU, live=False, cast="source", autocast=None, params="reference",
                                trusted=True),
}


def step_chunks(opt, budget_bytes: int | None = None) -> list[set[int] | None]:
    """The parameters (by id) of each shadow step: for torch's per-parameter optimizers, chunks of about
    `budget_bytes` (default `STEP_BYTES`), so a 7B model's optimizer rows need a chunk's memory, not a second
    copy of the model and its state; for any other optimizer one step over all (None)."""
    budget = STEP_BYTES if budget_bytes is None else budget_bytes
    kind = type(opt)
    if kind.__name__ not in PER_PARAMETER or getattr(torch.optim, kind.__name__, None) is not kind:
        return [None]
    chunks: list[set[int]] = [set()]
    size = 0
    for group in opt.param_groups:
        for p in group["params"]:
            nbytes = p.numel() * p.element_size()
            if chunks[-1] and size + nbytes > budget:
                chunks.append(set())
                size = 0
            chunks[-1].add(id(p))
            size += nbytes
    return list(chunks)


def shadow_step(opt, names: dict, rerunner: Rerunner, site: Site, chunk: set[int] | None = None,
                start: dict | None = None) -> dict:
    """A faithful copy of `opt` (`faithful_copy`) over fresh tensors holding the reference's weights and gradients
    (of the parameters in `chunk`, or all; `start`: canonical name -> (weight, gradient) to start from instead),
    stepped once at `site`; returns the updated weights by canonical name."""
    shadows, tensors = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            if chunk is not None and id(p) not in chunk:
                continue
            name = names.get(id(p))
            q = _shadow_parameter(p, name, rerunner, site, None if start is None else start.get(name))
            shadows[id(p)] = q
            tensors[name] = q
    shadow = faithful_copy(opt, shadows, plain=not site.live)
    if site.cast != "live":  # float64 and the reference's precision start from the reference's own recorded state
        _reference_state(shadow, {id(q): names.get(id(p)) for p, q in _pairs(opt, shadows)}, rerunner,
                         renamed(opt))
    with torch.no_grad(), trusted.running(site.trusted):
        shadow.step()
    return {name: t.detach() for name, t in tensors.items()}


def _reference_state(shadow, names: dict, rerunner: Rerunner, theirs: dict | None = None) -> None:
    """The state of each shadow parameter as the reference recorded it (`/optimizer_state`, when the reference holds
    it: a replay's optimizer loaded it, cast to its own dtypes), cast for the shadow parameter as torch's
    `load_state_dict` would; `theirs`: the reference's name of each key the optimizer keeps under another one
    (`record/start/state_names.py`)."""
    for group in shadow.param_groups:
        for q in group["params"]:
            state = shadow.state.get(q)
            name = names.get(id(q))
            for key in list(state or ()):
                ref_key = (theirs or {}).get(key, key)
                path = group_path(OPTIMIZER, optimizer_entry(name, ref_key)) if name else None
                if path is not None and rerunner.source.has(path):
                    state[key] = _for_param(q, key, rerunner.source.uncached(path).clone(), shadow.param_groups)


def _shadow_parameter(p, name, rerunner: Rerunner, site: Site, start):
    """A fresh leaf standing for parameter `p`: the reference's weight as its step found it (`Rerunner.step_start`)
    and its gradient (or `start`'s), in the site's dtype, on the site's device."""
    before = rerunner.step_start(name) if name else None
    if before is None:
        raise ProbeSkip(f"the reference has no state_before for a parameter of the optimizer ({name})")
    dtype = site.dtype_for(p.dtype, before.dtype)
    device = p.device if site.live else site.device
    if start is not None:
        q = start[0].to(device, dtype, copy=True)
        q.grad = None if start[1] is None else start[1].to(device, dtype, copy=True)
        return q.requires_grad_(p.requires_grad)
    q = before.to(device, dtype, copy=True)
    grad_path = step_grad_path(rerunner.source, name)
    if rerunner.source.has(grad_path):
        source = rerunner.source  # the probe's cache: a fresh read is ours, a remembered one is shared
        q.grad = source.uncached(grad_path).to(device, dtype, copy=source.cached(grad_path))
        divisor = getattr(rerunner, "grad_divisor", {}).get(name)
        if divisor is not None and grad_path == group_path(PARAM_GRADS, name):
            # divided between the last backward and the step, as the live one was (a reference that kept its step's
            # gradients in `/step_grads` holds them divided already)
            q.grad = q.grad.div(divisor)
    return q.requires_grad_(p.requires_grad)


_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


_CODE = (types.FunctionType, types.MethodType, types.BuiltinMethodType, functools.partial)


def faithful_copy(opt, shadows: dict, *, plain: bool = False):
    """A copy of the user's optimizer over other parameters: the same class, every instance attribute (a vendor
    constructor's options live there, not in the param groups), the param groups' options and the state, deep-
    copied with each parameter (by id) replaced by `shadows[id]`; parameters not in `shadows` are left out. Hooks
    and functions set on the instance (an LR scheduler's wrapped `step`, which calls the original's) are not
    copied: stepping the copy never touches the user's optimizer. `plain`: foreach/fused/capturable off (a CPU
    recomputation)."""
    import copy

    memo = {id(p): q for p, q in _pairs(opt, shadows)}
    shadow = object.__new__(type(opt))
    for key, value in vars(opt).items():
        if key in ("param_groups", "state") or key in _HOOKS or isinstance(value, _CODE):
            continue  # an LR scheduler's `step` wrapper calls the original's bound step: never copied
        setattr(shadow, key, copy.deepcopy(value, memo))
    for key in _HOOKS:
        if hasattr(opt, key):
            setattr(shadow, key, type(getattr(opt, key))())
    groups = []
    for group in opt.param_groups:
        params = [shadows[id(p)] for p in group["params"] if id(p) in shadows]
        if not params:
            continue
        options = {k: copy.deepcopy(v, memo) for k, v in group.items() if k != "params"}
        if plain:
            options.update({k: False for k in ("foreach", "fused", "capturable") if options.get(k)})
        groups.append({**options, "params": params})
    shadow.param_groups = groups
    state: collections.defaultdict[torch.Tensor, dict] = collections.defaultdict(dict)
    for p, q in _pairs(opt, shadows):
        if p in opt.state:  # each value as torch's load_state_dict gives it to q: in q's dtype and on its device
            state[q] = {key: _for_param(q, key, value, groups) for key, value in
                        copy.deepcopy(opt.state[p], memo).items()}
    shadow.state = state
    return shadow


def _for_param(q, key, value, groups: list[dict]):
    """An optimizer state value for the shadow parameter `q` (another dtype or device than the live one: the
    float64 step of the noise, the CPU), as `torch.optim.Optimizer.load_state_dict` casts it (`step` kept)."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.optim.Optimizer._process_value_according_to_param_policy(q, value, id(q), [
        {**g, "params": [id(x) for x in g["params"]]} for g in groups], key)


def _pairs(opt, shadows: dict):
    return [(p, shadows[id(p)]) for group in opt.param_groups for p in group["params"] if id(p) in shadows]


def optimizer_rows(opt, model, rerunner: Rerunner, device, needs_noise: Callable[[JudgedRow], bool],
                   expected: dict | None = None) -> tuple[list[JudgedRow], str]:
    """The target's optimizer, stepped from the reference's weights and gradients, against the reference's
    state_after: one row per parameter, or none and the reason the update cannot be judged. `expected` receives,
    per parameter, the digest of the update the live step must give (`check_updates`; `record/local/fidelity.py`).
    The caller has checked that the optimizer starts from the reference's state (`format/optimizer_state.py`)."""
    names = {id(p): n for n, p in parameters(model)}
    order = {n: i for i, n in enumerate(names.values())}
    rows: list[JudgedRow] = []
    chunks, apart = step_chunks(opt), _placed_apart(names, rerunner)
    if apart and chunks == [None]:
        return [], _apart_reason(apart, len(apart))
    for chunk in chunks:
        chunk = chunk if chunk is None else chunk - set(apart)
        if chunk is not None and not chunk:
            continue
        try:
            judged = shadow_step(opt, names, rerunner, _SITES["target"](device), chunk)
        except Exception as err:
            return [], f"could not be rerun: {type(err).__name__}: {first_line(err)}"
        mine = []
        for name, after in judged.items():
            wide = torch.promote_types(after.dtype, torch.float32)  # nearby floats subtract exactly there
            delta = _reference_delta(rerunner, name, wide)
            if delta is None:
                continue
            before = rerunner.step_start(name).to(_CPU, wide)
            mine.append((name, JudgedRow(owner(name), 0, "optimizer", leaf(name), dtype_name(after.dtype),
                                         tensor_stats(delta, after.to(_CPU, wide) - before),
                                         at=order.get(name, LATE))))
        if expected is not None:
            expected.update(_checked_updates(opt, names, rerunner, device, chunk, judged))
        del judged
        if any(needs_noise(row) for _, row in mine):
            _noise(opt, names, rerunner, mine, chunk)
        rows.extend(row for _, row in mine)
    return rows, _apart_reason(apart, len(apart)) if apart else ""


def _placed_apart(names: dict, rerunner: Rerunner) -> dict[int, tuple[str, str, str]]:
    """id -> (name, the gradient's placements, the parameter's) of each tensor-parallel parameter whose recorded
    gradient is placed otherwise than the parameter (a norm's Partial gradient under a Replicate weight): the step
    redistributes it, a collective no rerun runs."""
    attrs = getattr(rerunner.source, "attrs", None)
    if not callable(attrs):
        return {}
    found = {}
    for pid, name in names.items():
        weight = attrs(group_path(STATE_BEFORE, name)).get(PLACEMENTS)
        grad = attrs(group_path(PARAM_GRADS, name)).get(PLACEMENTS)
        if weight != grad and (weight or grad):
            found[pid] = (name, str(grad or "plain"), str(weight or "plain"))
    return found


def _apart_reason(apart: dict, count: int) -> str:
    name, grad, weight = next(iter(apart.values()))
    return (f"{count} parameters not judged: each gradient is placed otherwise than its parameter ({name}: {grad} "
            f"vs {weight}), so the step redistributes it (a collective, which no rerun runs)")


def _checked_updates(opt, names: dict, rerunner: Rerunner, device, chunk, judged: dict) -> dict[str, tuple]:
    """Fingerprints of the weights the live step must produce: the shadow step's, when every live weight and gradient
    of the chunk equals the reference's; else a step of the copy from the live ones."""
    live = {names[id(p)]: p for group in opt.param_groups for p in group["params"]
            if id(p) in names and (chunk is None or id(p) in chunk)}
    same = all(_exact_start(rerunner, name, p) for name, p in live.items())
    if not same:
        start = {name: (shard_of(p.detach()), None if p.grad is None else shard_of(p.grad)) for name, p in live.items()}
        judged = shadow_step(opt, names, rerunner, _SITES["target"](device), chunk, start=start)
    return {name: digest(after) for name, after in judged.items()}


def step_grad_path(source, name: str) -> str:
    """Where the reference keeps the gradient its step saw: `/step_grads` where code changed it after backward
    (clipping, unscaling: `clipping.py`), else `/param_grads`."""
    path = group_path(STEP_GRADS, name)
    return path if source.has(path) else group_path(PARAM_GRADS, name)


def _exact_start(rerunner: Rerunner, name: str, p) -> bool:
    before = rerunner.step_start(name)
    grad_path = step_grad_path(rerunner.source, name)
    if before is None or not exact_tensor(before, shard_of(p.detach())):
        return False
    if p.grad is None:
        return not rerunner.source.has(grad_path)
    return rerunner.source.has(grad_path) and exact_tensor(rerunner.source.uncached(grad_path), shard_of(p.grad))


def check_updates(model, expected: dict[str, tuple]) -> list[str]:
    """The parameters whose live value after the step differs from the checked shadow step's."""
    return [name for name, p in parameters(model) if name in expected and digest(shard_of(p)) != expected[name]]


def _noise(opt, names: dict, rerunner: Rerunner, rows: list[tuple[str, JudgedRow]], chunk: set[int] | None) -> None:
    """Each update's expected noise: the shadow step in float64, in the target's and the reference's precision."""
    try:
        steps = {s: shadow_step(opt, names, rerunner, _SITES[s](None), chunk) for s in ("high", "low", "reference")}
    except Exception as err:
        for _, row in rows:
            row.calibration = f"failed: {type(err).__name__}: {first_line(err)}"[:200]
        return
    for name, row in rows:
        before = rerunner.step_start(name).to(_CPU, torch.float64)
        deltas = {s: steps[s][name].to(_CPU, torch.float64) - before for s in steps}
        row.noise_target = max(rel_l2(deltas["high"], deltas["low"]), _storage_floor(steps["low"][name], deltas))
        row.noise_reference = max(rel_l2(deltas["high"], deltas["reference"]),
                                  _storage_floor(steps["reference"][name], deltas))
        row.calibration = "cpu"


def _storage_floor(after, deltas: dict) -> float:
    """The part of an update's error no implementation avoids: the updated weight rounded to its dtype (RMS
    u/sqrt(3) of each element), relative to the update. The measured noise of a tensor of a few elements can fall
    below it by chance (a bias of 4 whose rounding happened to be small); another formula's rounding cannot."""
    high = deltas["high"]
    norm = float(torch.linalg.vector_norm(high))
    if not norm or not after.is_floating_point():
        return 0.0
    rms = unit_roundoff(dtype_name(after.dtype)) / math.sqrt(3.0)
    return rms * float(torch.linalg.vector_norm(after.to(_CPU, torch.float64))) / norm


def _reference_delta(rerunner: Rerunner, name: str, wide):
    """The reference's update of a parameter, computed in `wide` or the reference's wider dtype."""
    before = rerunner.step_start(name)
    path = group_path(STATE_AFTER, name)
    if before is None or not rerunner.source.has(path):
        return None
    after = rerunner.source.uncached(path)
    wide = torch.promote_types(wide, torch.promote_types(after.dtype, before.dtype))
    return after.to(wide) - before.to(wide)
