"""Where every impact run starts: a copy of the recorded iteration's start, swapped in for a run and out after it.

Where this sits: `record --impact` (`runs.py`) runs the iteration again once per candidate, each time from exactly the
start the recorded iteration had — the reference's weights and buffers as a replay loaded them, the optimizer's state
and its param groups' options, the gradients the parameters held, and torch's (CPU and each accelerator's), Python's
and numpy's random generators as the block seeded them. `Start` copies all of it when the block begins (before the
model ran); `swapped_in()` puts a fresh copy of it into the live model and optimizers for one run, and puts the live
objects back afterwards, so the iteration the user's loop recorded ends as it ended, whatever the runs did.

The multi-step twin (`record/steps/twin.py`) swaps its own state in the same way; here nothing is perturbed and every
run starts from the same copy.
"""

from __future__ import annotations

import collections
import copy
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch

from oneiter.runtime import host_random

__all__ = ["Start"]


def _clone_state(state) -> collections.defaultdict:
    """An optimizer's state (a defaultdict, as torch's optimizers expect), every tensor copied."""
    return collections.defaultdict(dict, {
        p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in s.items()}
        for p, s in state.items()})


def _options(optimizer) -> list[dict]:
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


class Start:
    """A copy of the iteration's start (`Start(model, optimizers)`, taken before the model runs)."""

    def __init__(self, model, optimizers):
        self.model, self.optimizers = model, list(optimizers)
        self.params = [p for _, p in model.named_parameters()]
        self.weights = [p.detach().clone() for p in self.params]
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.buffers = [(m, name, b.detach().clone()) for m in model.modules()
                        for name, b in m._buffers.items() if b is not None]
        self.states = [_clone_state(opt.state) for opt in self.optimizers]
        self.groups = [_options(opt) for opt in self.optimizers]
        self.devices = _devices(self.params)
        self.rng = torch.get_rng_state()
        self.device_rng = {kind: [getattr(torch, kind).get_rng_state(i) for i in indices]
                           for kind, indices in self.devices.items() if hasattr(getattr(torch, kind, None),
                                                                                 "get_rng_state")}
        self.host = host_random.state()

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """A fresh copy of the start in the live model and optimizers (and the random generators where they were)
        for the block; the live objects back afterwards."""
        live_weights = [p.data for p in self.params]
        live_grads = [p.grad for p in self.params]
        live_buffers = [m._buffers[name] for m, name, _ in self.buffers]
        live_states = [opt.state for opt in self.optimizers]
        live_groups = [_options(opt) for opt in self.optimizers]
        live_host = host_random.state()
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            for kind, indices in self.devices.items():
                stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
            self._put_start()
            try:
                yield
            finally:
                for p, w, g in zip(self.params, live_weights, live_grads, strict=True):
                    p.data, p.grad = w, g
                for (m, name, _), b in zip(self.buffers, live_buffers, strict=True):
                    m._buffers[name] = b
                for opt, state, groups in zip(self.optimizers, live_states, live_groups, strict=True):
                    opt.state = state
                    for group, options in zip(opt.param_groups, groups, strict=True):
                        group.update(options)
                host_random.set_state(live_host)

    def _put_start(self) -> None:
        with torch.no_grad():
            for p, w, g in zip(self.params, self.weights, self.grads, strict=True):
                p.data = w.clone()
                p.grad = None if g is None else g.clone()
        for m, name, b in self.buffers:
            m._buffers[name] = b.clone()
        for opt, state, groups in zip(self.optimizers, self.states, self.groups, strict=True):
            opt.state = _clone_state(state)
            for group, options in zip(opt.param_groups, groups, strict=True):
                group.update(copy.deepcopy(options))
        torch.set_rng_state(self.rng)
        for kind, states in self.device_rng.items():
            for index, state in zip(self.devices[kind], states, strict=True):
                getattr(torch, kind).set_rng_state(state, index)
        host_random.set_state(self.host)


def _devices(params) -> dict[str, list[int]]:
    """Accelerator type -> the devices of it the parameters are on (whose generators a run starts where they were)."""
    found: dict[str, set[int]] = {}
    for p in params:
        if p.device.type != "cpu":
            found.setdefault(p.device.type, set()).add(p.device.index or 0)
    return {kind: sorted(indices) for kind, indices in found.items()}
