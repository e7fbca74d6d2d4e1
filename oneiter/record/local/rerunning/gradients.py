"""The gradients a rerun seeds its backward with: the part of each recorded output gradient that came from outside
the call (`external_grads`), and the call's own part of outputs it passes on from a forced child (`inherited`).

Where this sits: `rerun.py`'s backward, on the outputs of the call and the forced children (`forcing.py`)."""

from __future__ import annotations

from typing import Any

import torch

from oneiter.format.schema import grad_name

__all__ = ["external_grads", "inherited"]


def external_grads(pairs: list) -> tuple[list, dict]:
    """The gradient each output received from *outside* the call, from the recorded (total) ones.

    A recorded grad_output is the whole gradient w.r.t. that output. When the call also consumed one of its own
    outputs (`loss = f(logits)`, both returned), part of that whole came through the call's other outputs;
    backpropagating every output with its whole gradient would count that part twice. Taking the outputs from
    the last computed to the first, the part coming through later outputs is computed and subtracted.
    Returns the seeds for backward (in `pairs` order) and {grad name: the part that came through the call}.
    """
    if len(pairs) == 1:
        return [pairs[0][2]], {}
    order = sorted(range(len(pairs)), key=lambda i: -_sequence(pairs[i][1]))
    seeds: dict[int, Any] = {}
    internal = {}
    for position, i in enumerate(order):
        name, out, whole = pairs[i]
        later = order[:position]
        inner = None
        if later:
            inner = torch.autograd.grad([pairs[j][1] for j in later], [out], [seeds[j] for j in later],
                                        retain_graph=True, allow_unused=True)[0]
        seeds[i] = whole if inner is None else whole - inner
        if inner is not None:
            internal[grad_name(name)] = inner.detach()
    return [seeds[i] for i in range(len(pairs))], internal


def inherited(outputs: dict, forcing) -> dict:
    """Outputs this call passes on unchanged from a forced child that also consumed them itself: the child's
    own part of their gradient is part of this call's too (BERT's attention weights, returned up two levels)."""
    found = {}
    for name, out in outputs.items():
        child, slot = forcing.origin.get(id(out), (None, None))
        inner = child.internal.get(grad_name(slot)) if child is not None else None
        if inner is not None:
            found[grad_name(name)] = inner
    return found


def _sequence(tensor) -> int:
    return tensor.grad_fn._sequence_nr() if tensor.grad_fn is not None else -1
