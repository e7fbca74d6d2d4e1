"""A float64 rerun with the rounding of a lower precision injected into every op (Monte Carlo arithmetic).

Where this sits: the calibration checks its own noise estimates (`record/local/probe.py`, docs/blame.md "A noise
estimate is itself checked"): a call's precision-only noise may not be far above what that precision can produce
for the call. What it can produce is measured on the trusted path, with no kernel of that precision: the call is
rerun on the CPU in float64 (torch's kernels: `trusted.py`) under `RoundoffInjection`, a TorchDispatchMode that
multiplies each floating input of each op by (1 ± δ) and each result by (1 ± δ) (`runtime/roundoff.py`: the
accumulation over its reduction on the terms and on each result that sums; the inputs of the matmuls and
convolutions a float32 run computes in TF32/HF32 at least at that mode's roundoff). The spread of a few such runs
around the plain float64 run is the bound; an op that amplifies (a normalisation's backward) amplifies the injected
errors as it would the real ones, and a sum that cancels loses the digits of its terms.

Ops that compute nothing (views, copies, casts) and random draws (their values are the reference's) are left alone:
a correct kernel of any precision gives them exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oneiter.record.modes.randomness import is_random
from oneiter.runtime.precision_modes import FAMILY_OPS, MANTISSA_BITS
from oneiter.runtime.roundoff import inject, perturbed_, result_delta

__all__ = ["RoundoffInjection", "COPIES", "UNINITIALIZED"]

# ops that move, cast or copy values without computing new ones, and ops whose outputs hold no values yet
COPIES = frozenset({"_to_copy", "to", "clone", "copy_", "detach", "alias", "lift_fresh", "lift_fresh_copy",
                    "_unsafe_view", "contiguous", "_copy_from", "_copy_from_and_resize"})
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
                           "empty_permuted"})


class RoundoffInjection(TorchDispatchMode):
    """Perturbs every op's floating results at `roundoff` (`accumulate`: the accumulator's, for reductions) with
    signs from a generator seeded `seed`; `families`: (family, mode) pairs whose float32 operands are perturbed at
    that mode's roundoff."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # an eager-only mode

    def __init__(self, seed: int, roundoff: float, accumulate: float, families: tuple = ()):
        super().__init__()
        self.roundoff, self.accumulate = roundoff, accumulate
        self.rng = np.random.default_rng(seed)
        self.operand = {op: 2.0 ** -(MANTISSA_BITS[mode] + 1) for family, mode in families
                        for op in FAMILY_OPS[family]}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.is_view or name in COPIES or name in UNINITIALIZED or is_random(func, args, kwargs):
            return func(*args, **kwargs)
        # tensors only: a dtype argument (`sum(..., dtype=torch.float32)`) has an `is_floating_point` too, a bool
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(t.is_floating_point() for t in tensors):
            return func(*args, **kwargs)  # a factory or an index op: nothing computed from floating values
        args, kwargs = inject(func, args, kwargs, self.roundoff, self.accumulate, self.rng,
                              self.operand.get(name, 0.0))
        out = func(*args, **kwargs)
        produced = {id(t): t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()}
        results = list(produced.values())
        for value in results:
            perturbed_(value, result_delta(func, args, results, value, self.roundoff, self.accumulate), self.rng)
        return out
