"""The optimizer rows of a teacher-forced replay: each parameter's update judged on its own.

The target's optimizer is copied over fresh tensors holding the reference's weights and gradients and stepped
once (`shadow_step`); its update (after - before) is judged against the reference's (state_after - state_before).
A copy of every weight, gradient and optimizer state at once would double a large model's memory, so torch's
per-parameter optimizers (`PER_PARAMETER`: each parameter updated from its own gradient and state only) are
stepped in chunks of about `STEP_BYTES` of parameters (`step_chunks`), each freed before the next; any other
optimizer (a subclass, LBFGS, the user's own: its step may couple parameters) steps once over all.
When a row's error is above roundoff, its noise is measured like any call's: the same shadow step in float64,
in the target's and in the reference's precision, on the CPU.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.optim

from oneiter.format.schema import PARAM_GRADS, STATE_AFTER, group_path
from oneiter.record import trusted
from oneiter.record.rerun import ProbeSkip, Rerunner, Site, rel_l2, tensor_stats
from oneiter.record.rows import LATE, JudgedRow, dtype_name, first_line, leaf, owner

__all__ = ["PER_PARAMETER", "STEP_BYTES", "step_chunks", "shadow_step", "optimizer_rows"]

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
    return chunks


def shadow_step(opt, names: dict, rerunner: Rerunner, site: Site, chunk: set[int] | None = None) -> dict:
    """A copy of `opt` over fresh tensors holding the reference's weights and gradients (of the parameters in
    `chunk`, or all), stepped once at `site`; returns the updated weights by canonical name."""
    groups, tensors = [], {}
    for group in opt.param_groups:
        params = []
        for p in group["params"]:
            if chunk is not None and id(p) not in chunk:
                continue
            name = names.get(id(p))
            before = rerunner.reference_state(name) if name else None
            grad_path = group_path(PARAM_GRADS, name)
            if before is None:
                raise ProbeSkip(f"the reference has no state_before for a parameter of the optimizer ({name})")
            dtype = site.dtype_for(p.dtype, before.dtype)
            device = p.device if site.live else site.device
            q = before.to(device, dtype, copy=True)
            if rerunner.source.has(grad_path):
                source = rerunner.source  # the probe's cache: a fresh read is ours, a remembered one is shared
                q.grad = source.uncached(grad_path).to(device, dtype, copy=source.cached(grad_path))
            params.append(q)
            tensors[name] = q
        if not params:
            continue
        options = {k: v for k, v in group.items() if k != "params"}
        if not site.live:
            options.update({k: False for k in ("foreach", "fused", "capturable") if options.get(k)})
        groups.append({"params": params, **options})
    shadow = type(opt)(groups, **({"lr": groups[0]["lr"]} if groups and "lr" in groups[0] else {}))
    with torch.no_grad(), trusted.running(site.trusted):
        shadow.step()
    return {name: t.detach() for name, t in tensors.items()}


def optimizer_rows(opt, model, rerunner: Rerunner, device,
                   needs_noise: Callable[[JudgedRow], bool]) -> tuple[list[JudgedRow], str]:
    """The target's optimizer, stepped from the reference's weights and gradients, against the reference's
    state_after: one row per parameter, or none and the reason the update cannot be judged."""
    if any(len(state) for state in opt.state.values()):
        return [], "the optimizer has state from earlier iterations, which a recording does not hold"
    names = {id(p): n for n, p in model.named_parameters()}
    order = {n: i for i, n in enumerate(names.values())}
    rows = []
    for chunk in step_chunks(opt):
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
            before = rerunner.reference_state(name).to(_CPU, wide)
            mine.append((name, JudgedRow(owner(name), 0, "optimizer", leaf(name), dtype_name(after.dtype),
                                         tensor_stats(delta, after.to(_CPU, wide) - before),
                                         at=order.get(name, LATE))))
        del judged
        if any(needs_noise(row) for _, row in mine):
            _noise(opt, names, rerunner, mine, chunk)
        rows.extend(row for _, row in mine)
    return rows, ""


def _noise(opt, names: dict, rerunner: Rerunner, rows: list[tuple[str, JudgedRow]], chunk: set[int] | None) -> None:
    """Each update's expected noise: the shadow step in float64, in the target's and the reference's precision."""
    try:
        steps = {s: shadow_step(opt, names, rerunner, _SITES[s](None), chunk) for s in ("high", "low", "reference")}
    except Exception as err:
        for _, row in rows:
            row.calibration = f"failed: {type(err).__name__}: {first_line(err)}"[:200]
        return
    for name, row in rows:
        before = rerunner.reference_state(name).to(_CPU, torch.float64)
        deltas = {s: steps[s][name].to(_CPU, torch.float64) - before for s in steps}
        row.noise_target = rel_l2(deltas["high"], deltas["low"])
        row.noise_reference = rel_l2(deltas["high"], deltas["reference"])
        row.calibration = "cpu"


def _reference_delta(rerunner: Rerunner, name: str, wide):
    """The reference's update of a parameter, computed in `wide` or the reference's wider dtype."""
    before = rerunner.reference_state(name)
    path = group_path(STATE_AFTER, name)
    if before is None or not rerunner.source.has(path):
        return None
    after = rerunner.source.uncached(path)
    wide = torch.promote_types(wide, torch.promote_types(after.dtype, before.dtype))
    return after.to(wide) - before.to(wide)
