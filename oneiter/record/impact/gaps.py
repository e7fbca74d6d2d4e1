"""How far one run of the iteration lands from the reference: its loss, its parameter gradients, its updated weights.

Where this sits: every impact run (`impact_pass.py`) ends with its `Gaps`, measured against the reference file the
replay is of; `runs.py` writes them into `/impact`, and compare turns them into shares of the gap each fix closes
(`judge/iteration/impact.py`). Statistics only, in float64, summed over every parameter:

    loss_gap   = |loss - loss_ref|
    grad_gap   = ||g - g_ref|| / ||g_ref||              over every parameter gradient, read when backward returns
    weight_gap = ||w' - w'_ref|| / ||w'_ref - w_0||      the updated weights against the reference's update

Buffers are left out; a parameter the reference holds no gradient (or update) of is too. NaN where nothing is left to
measure (no optimizer: no update; a multi-step reference, whose steps keep statistics of their tensors: only the loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oneiter.format.schema import LOSS, PARAM_GRADS, STATE_AFTER, STATE_BEFORE
from oneiter.format.stats import pair_sums
from oneiter.record.capture.hooks import unscaled
from oneiter.runtime.names import parameters

__all__ = ["Gaps", "ReferenceGaps"]


@dataclass(frozen=True)
class Gaps:
    """One run's distance from the reference (see the module docstring)."""

    loss: float
    loss_gap: float
    grad_gap: float
    weight_gap: float
    reference_loss: float = math.nan


def _sums(pairs) -> tuple[float, float]:
    """(sum of ||a - b||^2, sum of ||b||^2) in float64 over (a, b) pairs of tensors: the C kernel's one pass over
    each (`format.stats.pair_sums`) where it applies, else torch's reductions."""
    diff = norm = 0.0
    for mine, theirs in pairs:
        work = torch.promote_types(torch.promote_types(mine.dtype, theirs.dtype), torch.float32)
        a = mine.detach().reshape(-1).to("cpu", work).contiguous()
        b = theirs.reshape(-1).to(work).contiguous()
        sums: tuple[float, ...] | None = pair_sums(a, b)
        if sums is None:
            a, b = a.double(), b.double()
            sums = (0.0, float(torch.sum(b ** 2)), float(torch.sum((a - b) ** 2)))
        diff += sums[2]
        norm += sums[1]
    return diff, norm


def _ratio(diff: float, norm: float) -> float:
    if norm > 0:
        return math.sqrt(diff / norm)
    return 0.0 if diff == 0 else math.nan


class ReferenceGaps:
    """The reference's loss, parameter gradients and updated weights, and a run's distance from them."""

    def __init__(self, ref, model):
        self.ref = ref
        self.params = [(name, p) for name, p in parameters(model)]
        values = ref.read(LOSS).reshape(-1) if ref.has(LOSS) else []
        self.loss = float(values[0]) if len(values) == 1 else math.nan
        # a multi-step reference keeps statistics of its steps' tensors: only its loss is compared there
        self._grads = self._full(ref.state(PARAM_GRADS))
        self._after = self._full(ref.state(STATE_AFTER))
        self._before = self._full(ref.state(STATE_BEFORE))
        self._update_norm: float | None = None

    def _full(self, paths: dict[str, str]) -> dict[str, str]:
        return {} if any(self.ref.is_stats(p) for p in paths.values()) else paths

    def loss_gap(self, loss: float) -> float:
        return abs(loss - self.loss)

    def grads(self, scale: float = 1.0) -> float:
        """`grad_gap` of the model's gradients now (divided by a loss scale: the reference's are unscaled)."""
        if not self._grads:
            return math.nan
        pairs = ((unscaled(p.grad, scale), self.ref.tensor(self._grads[name]))
                 for name, p in self.params if p.grad is not None and name in self._grads)
        return _ratio(*_sums(pairs))

    def weights(self) -> float:
        """`weight_gap` of the model's weights now (after the step)."""
        names = [(name, p) for name, p in self.params if name in self._after and name in self._before]
        if not names:
            return math.nan
        diff, _ = _sums((p, self.ref.tensor(self._after[name])) for name, p in names)
        if self._update_norm is None:  # the reference's own update, read once
            self._update_norm = sum(float(torch.sum((self.ref.tensor(self._after[n]).to(torch.float64)
                                                     - self.ref.tensor(self._before[n]).to(torch.float64)) ** 2))
                                    for n, _ in names)
        return _ratio(diff, self._update_norm)
