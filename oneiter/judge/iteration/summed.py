"""Gradients summed from several readers: which backward entries a gradient is the sum of, and what its drift may
inherit from them.

Sits beside `blame.py`, which asks it when it holds an entry no probe covers to what it was computed from. A tensor
that several calls read gets one gradient, the sum of what each reader hands back for it: an encoder's last hidden
state read by every decoder layer's cross-attention (T5, BART), a speech model's `extract_features` read by its
projection (Wav2Vec2), a skip connection, a model output the model also reads itself. The gradient the model's
output receives is then the loss's part plus its readers' parts, and its drift is explained by theirs.

Who read a tensor is in the forward rows: the names captured of one tensor object are hard links to one stored
dataset (`format/layout.py`), so the rows of one reference dataset are one tensor. Its readers are the calls that
hold it as an input (`input.*`, `kwarg.*`); a reader inside another reader is part of that one's gradient and is
left out, and so is a call that returns the tensor it read (an identity, a value handed on: its gradient is the
whole tensor's, no part of it).

The drift a sum inherits is bounded by its terms in absolute terms: ||dS|| <= sum_i ||dT_i||, and each term carries
at least its precision's rounding, so

    inherited(S) = sum_i max(e_i, u) * ||T_i|| / ||S||          (e_i: term i's accumulated rel_l2, u: the floor)

with the reference's norms. A sum whose terms cancel (a loss flat in exact arithmetic: the squared mean of a
normalised output is 1 whatever the input, so every gradient upstream of the norm is rounding) has ||S|| far below
sum_i ||T_i||: its magnitude is at the precision's floor relative to what it was summed from, and the bound says
so. Without norms (a statistics-level file) the largest term's error stands for the sum.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from oneiter.format.schema import BACKWARD, FORWARD
from oneiter.judge.iteration.entries import Key

__all__ = ["readers_gradients", "inherited"]


def readers_gradients(rows: list, stored: list, parents: dict) -> dict[Key, list[Key]]:
    """grad_output key of every call output that some call read -> the backward keys (`grad_input.*`,
    `grad_kwarg.*` of its outermost readers) it is summed from; only keys the rows hold with numbers."""
    if len(stored) != len(rows):  # not the rows' own datasets: no readers known
        return {}
    measured = {r.key for r in rows if r.metrics is not None}
    tensors: dict[object, list[Key]] = {}
    for r, ident in zip(rows, stored, strict=True):
        if ident is not None and r.phase == FORWARD:
            tensors.setdefault(ident[0], []).append(r.key)
    found: dict[Key, list[Key]] = {}
    for keys in tensors.values():
        outputs = [k for k in keys if k[3].startswith("output")]
        inputs = [k for k in keys if k[3].startswith(("input", "kwarg"))]
        if not outputs or not inputs:
            continue
        returned = {(k[0], k[1]) for k in outputs}
        readers = [k for k in inputs if (k[0], k[1]) not in returned]
        calls = {(k[0], k[1]) for k in readers}
        outer = [k for k in readers if not _inside(parents, (k[0], k[1]), calls)]
        grads = [Key(k.module, k.call, BACKWARD, f"grad_{k.tensor}") for k in outer]
        grads = [g for g in dict.fromkeys(grads) if g in measured]
        if not grads:
            continue
        for m, c, _, tensor in outputs:
            grad = Key(m, c, BACKWARD, "grad_" + tensor)
            if grad in measured:
                found[grad] = grads
    return found


def _inside(parents: dict, call: tuple[str, int], others: set) -> bool:
    """Whether a call runs inside one of `others` (its parents' chain meets one)."""
    at, seen = parents.get(call), {call}
    while at is not None and at not in seen:
        if at in others:
            return True
        seen.add(at)
        at = parents.get(at)
    return False


def inherited(terms: list[Key], total: Key, errors: dict[Key, float], floor: float,
              norm: Optional[Callable[[Key], Optional[float]]]) -> float:
    """The relative drift the sum `total` may inherit from its `terms` (module docstring); 0.0 without terms."""
    errs = [errors.get(t, math.nan) for t in terms]
    errs = [max(e, floor) for e in errs if not math.isnan(e)]
    if len(errs) != len(terms) or not terms:
        return max(errs, default=0.0)
    sizes = [norm(t) for t in terms] if norm is not None else []
    whole = norm(total) if norm is not None else None
    known = [s for s in sizes if s is not None and math.isfinite(s)]
    if not whole or len(known) != len(sizes) or not math.isfinite(whole):
        return max(errs)
    return sum(e * s for e, s in zip(errs, known, strict=True)) / whole
