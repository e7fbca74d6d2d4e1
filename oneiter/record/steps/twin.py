"""The perturbed twin of a multi-step replay: the band of what the run's precision explains, measured on the run.

Where this sits: a replay of a multi-step reference (`record/steps/step_recorder.py`) runs each iteration twice. First
the target's own step, recorded; then the same step of a **twin** — the target's own code, device, precision, batch
and random values, on the same model and optimizer objects, but with its own weights, buffers and optimizer state
(`Twin`), swapped in for the pass and out again. Before each of its forwards the twin's weights are perturbed by
one rounding of the run's precision, w * (1 ± 2u) with random signs from a fixed seed (u: the unit roundoff of
the lower of the two runs' precisions); the perturbation is taken off again before its optimizer steps, so the
gradient is computed at perturbed weights (every rounding of the forward and backward comes out another way, as a
second implementation in the same precision would round) and the update lands on clean weights (the weights keep
no perturbation of their own: in a real run they are rounded only by the update). The twin starts where the
target started, so how far its signature (`format/signature.py`) drifts from the target's, step after step, is what
the precision explains for this model, learning rate and optimizer: rounding injected at every step, amplified by
the training dynamics. `judge/stepwise/step_compare.py` turns it into the band (docs/steps.md: how the factor was
measured).

The twin is a model of the computation, so it is checked against the computation first (`check`): on the first
step, a copy of the twin run *without* perturbation must give the target's own signature bit for bit (on the
CPU; elsewhere its distance is kept and widens the band).

What a pass keeps from the live run: the RNG states (forked and restored), the optimizer's param-group options
(a learning-rate scheduler stepped inside the pass is undone), the live weights, gradients, buffers and state.
What it does not undo: other side effects of the step function (it runs twice per step: keep logging and data
loading out of it, or let them run twice).
"""

from __future__ import annotations

import collections
import copy
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch

from oneiter.record.capture.optimizer_step import before_update
from oneiter.record.impact.impact_pass import ReferencePass
from oneiter.record.local.rerun import scaled_by_signs
from oneiter.runtime.sharding import is_dtensor, placement_of, shard_of

__all__ = ["Twin", "TwinPass", "perturbation_seed"]


def perturbation_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s perturbation signs (reproducible, different per step)."""
    return (int(seed) * 1_000_003 + int(step) * 7919 + 17) % (2**63 - 1)


def _clone_state(state) -> dict:
    """An optimizer's state (a defaultdict, as torch's optimizers expect), every tensor copied."""
    return collections.defaultdict(dict, {
        p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in s.items()}
        for p, s in state.items()})


class Twin:
    """The twin's own state: a copy of every parameter, gradient, buffer and optimizer state of the live run,
    taken when the run starts (`Twin(model, optimizers, roundoff, seed)`)."""

    def __init__(self, model, optimizers, roundoff: float, seed: int):
        self.model, self.optimizers = model, list(optimizers)
        self.roundoff, self.seed = float(roundoff), int(seed)
        self.params = [p for _, p in model.named_parameters()]
        self.weights = [shard_of(p.detach()).clone() for p in self.params]  # a DTensor's: this rank's shard
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.buffers = [(m, name, b.detach().clone()) for m in model.modules()
                        for name, b in m._buffers.items() if b is not None]
        self.states = [_clone_state(opt.state) for opt in self.optimizers]

    def copy(self) -> "Twin":
        """An independent copy (the check runs on one and throws it away)."""
        twin = copy.copy(self)
        twin.weights = [w.clone() for w in self.weights]
        twin.grads = [None if g is None else g.clone() for g in self.grads]
        twin.buffers = [(m, name, b.clone()) for m, name, b in self.buffers]
        twin.states = [_clone_state(s) for s in self.states]
        return twin

    @contextmanager
    def swapped_in(self, step: int, *, perturb: bool = True) -> Iterator[None]:
        """The twin's state in the live model and optimizers for the block (weights perturbed for its forward and
        backward when `perturb`), the live state back afterwards; the twin keeps what the block made of its own."""
        live_weights = [_take(p) for p in self.params]
        live_grads = [p.grad for p in self.params]
        live_buffers = [m._buffers[name] for m, name, _ in self.buffers]
        live_states = [opt.state for opt in self.optimizers]
        live_groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                       for opt in self.optimizers]
        clean = list(self.weights)
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU's generator
            for kind, indices in _devices(self.params).items():  # and each accelerator's the parameters are on
                stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
            with torch.no_grad():
                for index, (p, w, g) in enumerate(zip(self.params, clean, self.grads, strict=True)):
                    _put(p, self._perturbed(p, w, step, index) if perturb and w.is_floating_point() else w)
                    p.grad = g
            self._dirty = perturb
            for m, name, b in self.buffers:
                m._buffers[name] = b
            for opt, state in zip(self.optimizers, self.states, strict=True):
                opt.state = state
            handles = [before_update(opt, lambda: self._unperturb(clean)) for opt in self.optimizers]
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()
                self._unperturb(clean)  # a pass that never stepped: its weights are the clean ones
                self.weights = [_take(p) for p in self.params]
                self.grads = [p.grad for p in self.params]
                self.buffers = [(m, name, m._buffers[name]) for m, name, _ in self.buffers]
                self.states = [opt.state for opt in self.optimizers]
                for p, w, g in zip(self.params, live_weights, live_grads, strict=True):
                    _put(p, w)
                    p.grad = g
                for (m, name, _), b in zip(self.buffers, live_buffers, strict=True):
                    m._buffers[name] = b
                for opt, state, groups in zip(self.optimizers, live_states, live_groups, strict=True):
                    opt.state = state
                    for group, options in zip(opt.param_groups, groups, strict=True):
                        group.update(options)

    _dirty = False  # the perturbed weights are in the parameters

    def _unperturb(self, clean: list) -> None:
        """The clean weights back under the perturbed ones (the gradients stay: computed at the perturbed ones)."""
        if not self._dirty:
            return
        self._dirty = False
        with torch.no_grad():
            for p, w in zip(self.params, clean, strict=True):
                _put(p, w)

    def _perturbed(self, param, weight, step: int, index: int):
        """w * (1 ± 2u), the signs random from (seed, step, the parameter's position), computed in float32 (or
        float64 for float64 weights) and stored in the weight's dtype. A DTensor parameter's signs are drawn for the
        full tensor and this rank's shard of them taken (`weight` is the shard): a replicated parameter gets the
        same perturbation on every rank, and the full tensor the one a single process would give it."""
        gen = torch.Generator().manual_seed(perturbation_seed(self.seed, step) + index)
        signs = torch.randint(0, 2, tuple(param.shape), generator=gen, dtype=torch.int8)
        if is_dtensor(param):
            placed = placement_of(param)
            assert placed is not None  # a DTensor's placement
            offset = placed[2] or (0,) * signs.dim()
            signs = signs[tuple(slice(o, o + n) for o, n in zip(offset, weight.shape, strict=True))]
        return scaled_by_signs(weight, signs, 2.0 * self.roundoff)


def _take(param):
    """The weight in `param` now, to keep: its tensor itself, or a copy of this rank's shard of a DTensor."""
    return shard_of(param.detach()).clone() if is_dtensor(param) else param.data


def _put(param, weight) -> None:
    """`weight` (from `_take`) into `param`: under `.data`, or a DTensor's shard copied into its storage in place —
    FSDP2 all-gathers from the storage `fully_shard` put the shard in and the optimizer updates that storage, so a
    new tensor under `.data` would reach neither."""
    if is_dtensor(param):
        with torch.no_grad():
            shard_of(param.detach()).copy_(weight)
    else:
        param.data = weight


def _devices(params) -> dict[str, list[int]]:
    """Accelerator type -> the devices of it whose RNG a pass must leave as it found it (the CPU's is forked
    apart)."""
    found: dict[str, set[int]] = {}
    for p in params:
        if p.device.type != "cpu":
            found.setdefault(p.device.type, set()).add(p.device.index or 0)
    return {kind: sorted(indices) for kind, indices in found.items()}


class TwinPass(ReferencePass):
    """What a twin's pass runs under: the reference step's batch of each microbatch (handed out by `inputs`, or
    swapped into the model's call that begins it) and random values, autocast as the recording has it, the op
    fallback; its loss is each microbatch's first backward's tensor (or the one `loss` names), summed:
    `record/impact/impact_pass.py`'s `ReferencePass`, which an impact run is too."""
