"""The forced children of a rerun: each returns the source's recorded output and, in backward, hands back the
source's recorded gradient w.r.t. its inputs (`Forcing`, with the autograd Function `Forced`).

Where this sits: `rerun.py`'s `Rerunner` enters a `Forcing` around one call's rerun; what the caller's own code
gave its children and received from them is kept there for the rerun's result."""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from oneiter.format.schema import BACKWARD, PLACEMENTS, child_tensor, grad_name, tensor_path
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.capture.structure import fill, flatten_call
from oneiter.record.local.rerunning.site import ProbeSkip, Site
from oneiter.runtime.sharding import parse_placements, spec_of, to_placed

__all__ = ["Forcing"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks")
_ABSENT = object()


class Forcing:
    """While active, each forced child call returns the source's recorded output and, in backward, hands back the
    source's recorded gradient w.r.t. its inputs; what the caller's own code gave and received is kept.
    `rerunner`: the `Rerunner` (`rerun.py`) whose source and perturbation the stand-ins read."""

    def __init__(self, children: list[CallRecord], rerunner, site: Site, anchor):
        self.rerunner, self.site, self.anchor = rerunner, site, anchor
        self.queues: dict[int, deque] = {}
        self.modules: dict[int, Any] = {}
        for child in children:
            self.queues.setdefault(id(child.module), deque()).append(child)
            self.modules[id(child.module)] = child.module
        self.inputs: dict[str, Any] = {}
        self.grad_outputs: dict[str, Any] = {}
        # id -> version of the tensors handed to the caller; `_alive` keeps them, so no id is reused meanwhile
        self.produced: dict[int, int] = {}
        self._alive: list = []
        self.origin: dict[int, tuple] = {}  # id of a forced output -> (child record, output name)
        self._saved: list = []
        self._calls: list[_ForcedCall] = []

    def __enter__(self):
        for module in self.modules.values():
            # through the instance's own dict: a torch.compile wrapper forwards other attributes to its `_orig_mod`;
            # a module compiled in place runs its compiled call (`_compiled_call_impl`) unless it is cleared
            own = module.__dict__
            saved = {n: own[n] for n in (*_HOOK_DICTS, "_compiled_call_impl") if n in own}
            self._saved.append((module, own.get("forward", _ABSENT), saved))
            for n in saved:
                own[n] = None if n == "_compiled_call_impl" else OrderedDict()
            own["forward"] = functools.partial(self._forward, module)
        return self

    def __exit__(self, exc_type, exc, tb):
        for module, forward, saved in self._saved:
            if forward is _ABSENT:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = forward
            module.__dict__.update(saved)
        self._saved.clear()
        # each stand-in's autograd node holds its _ForcedCall, which held this object and so the stand-in's own
        # outputs (whose grad_fn is that node): a cycle through C++ that Python's collector cannot see, which kept
        # every rerun's tensors alive (~0.7 GB per resnet18 replay). The rerun's backward has run: cut it.
        for info in self._calls:
            info.forcing, info.values = None, []
        self._calls.clear()
        if exc_type is None:
            left = [c.key for q in self.queues.values() for c in q]
            if left:
                raise ProbeSkip(f"the rerun did not call {left[0]} (the calls depend on more than the inputs)")
        return False

    def _forward(self, module, *args, **kwargs):
        queue = self.queues[id(module)]
        if not queue:
            raise ProbeSkip(f"the rerun called {type(module).__name__} more often than the recorded call did")
        child = queue.popleft()
        given, grad_inputs = self._take_inputs(child, args, kwargs)
        outs, grad_slots = self._stand_in_outputs(child, given)
        if grad_slots:
            self._force(child, grad_inputs, grad_slots, outs)
        for slot in child.output.slots:  # one tensor returned in several places: the same one again there
            if slot.alias is not None and slot.name not in outs:
                outs[slot.name] = outs[slot.alias]
        self._hand_out(child, given, outs)
        return fill(child.output, lambda slot: outs[slot.name])

    def _take_inputs(self, child: CallRecord, args: tuple, kwargs: dict) -> tuple[dict, list]:
        """The tensors the caller handed the child (kept in `inputs`), and those a gradient flows back to: a tensor
        handed in several places once (the recorded gradient of each place is the tensor's whole, summed)."""
        grad_inputs, given, once = [], {}, set()
        for name, value in flatten_call(args, kwargs):
            if isinstance(value, torch.Tensor):
                given[name] = value
                self.inputs[child_tensor(child.key, name)] = value
                if value.requires_grad and value.is_floating_point() and id(value) not in once:
                    once.add(id(value))
                    grad_inputs.append((name, value))
        return given, grad_inputs

    def _stand_in_outputs(self, child: CallRecord, given: dict) -> tuple[dict, list]:
        """The child's recorded outputs, by slot; those that need a gradient are returned apart (in slot order), to
        go through the stand-in's autograd node."""
        outs, grad_slots = {}, []
        assert child.output is not None  # the child returned: its outputs are recorded
        for slot in child.output.slots:
            if slot.alias is not None:  # the same tensor as an earlier slot (`_forward` fills it in)
                continue
            if child.identity.get(slot.name) in given:  # the child returned this input itself: so does its stand-in
                outs[slot.name] = given[child.identity[slot.name]]
                continue
            value = self.rerunner.recorded_output(child, slot, self.site)
            if slot.requires_grad and value.is_floating_point():
                grad_slots.append((slot, value))
            else:
                outs[slot.name] = to_placed(value, slot.placed)
        return outs, grad_slots

    def _force(self, child: CallRecord, grad_inputs: list, grad_slots: list, outs: dict) -> None:
        """Put the outputs that need a gradient in `outs` as outputs of a stand-in autograd node (`Forced`)."""
        aliases: dict[str, list] = {}
        assert child.output is not None  # the child returned: its outputs are recorded
        for slot in child.output.slots:
            aliases.setdefault(slot.alias or slot.name, []).append(slot.name)
        info = _ForcedCall(self, child, [n for n, _ in grad_inputs], [slot.name for slot, _ in grad_slots],
                           [v for _, v in grad_slots], aliases)
        self._calls.append(info)
        results = _forced_function().apply(info, self.anchor, *[v for _, v in grad_inputs])
        for (slot, _), value in zip(grad_slots, results, strict=True):  # Forced returns one value per slot
            outs[slot.name] = to_placed(value, slot.placed)  # a DTensor output: placed as the live one was

    def _hand_out(self, child: CallRecord, given: dict, outs: dict) -> None:
        """Note the outputs the child produced (not inputs it passed on) as handed to the caller, and keep them."""
        passed_on = {id(given[n]) for n in child.identity.values() if n in given}
        self.produced.update((id(v), v._version) for v in outs.values() if id(v) not in passed_on)
        self._alive.extend(outs.values())
        for name, value in outs.items():
            if id(value) not in passed_on:
                self.origin[id(value)] = (child, name)

    def grad_for(self, child: CallRecord, name: str, like, spec: tuple | None = None):
        """The source's gradient w.r.t. a forced child's input, like `like` (placed as a DTensor input was: `spec`)."""
        path = tensor_path(child.key, BACKWARD, grad_name(name))
        if not self.rerunner.source.has(path):
            return None
        grad = self.rerunner.perturb(self.rerunner.source.tensor(path).to(like.device, like.dtype, copy=True))
        if spec is not None:
            attrs = getattr(self.rerunner.source, "attrs", None)
            text = attrs(path).get(PLACEMENTS) if callable(attrs) else None
            grad = to_placed(grad, spec, parse_placements(text) if text else None)
        self.produced[id(grad)] = grad._version
        self._alive.append(grad)
        return grad


@dataclass
class _ForcedCall:
    forcing: Forcing | None  # None once the rerun is over (`Forcing.__exit__`)
    child: CallRecord
    input_names: list
    output_names: list
    values: list
    aliases: dict = field(default_factory=dict)  # output name -> every name it was returned under (itself first)


@functools.lru_cache(maxsize=None)
def _forced_function():
    class Forced(torch.autograd.Function):
        """Forward: the recorded outputs of a child call. Backward: keep the gradient arriving at them, return the
        recorded gradient w.r.t. the child's inputs."""

        @staticmethod
        def forward(ctx, info: _ForcedCall, anchor, *inputs):
            ctx.info = info
            ctx.likes = [torch.empty((), dtype=t.dtype, device=t.device) for t in inputs]
            ctx.specs = [spec_of(t) for t in inputs]
            return tuple(info.values)

        @staticmethod
        def backward(ctx, *grads):
            info = ctx.info
            for name, grad in zip(info.output_names, grads, strict=True):  # one per forward output
                # an output the child also consumed itself (logits of a model that returns the loss computed from
                # them): its recorded gradient holds the child's own part, which the reference file does not
                # separate, so what the caller hands it cannot be judged
                if grad is not None and grad_name(name) not in info.child.internal:
                    for each in info.aliases.get(name, [name]):  # every place the tensor was returned in
                        info.forcing.grad_outputs[child_tensor(info.child.key, grad_name(each))] = grad
            likes = zip(info.input_names, ctx.likes, ctx.specs, strict=True)  # all one per input
            back = [info.forcing.grad_for(info.child, name, like, spec) for name, like, spec in likes]
            return (None, None, *back)

    return Forced

