"""Where and how one rerun of a recorded call happens (`Site`), the Monte Carlo perturbation a site may ask for
(`Perturbation`), and what the rerun returns (`RunResult`). Where this sits: `rerun.py`'s `Rerunner` takes a `Site`
and returns a `RunResult`; the probes (`probe.py`) choose the sites and judge the results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from oneiter.runtime.precision import unit_roundoff

__all__ = ["AMBIENT", "ProbeSkip", "Site", "Perturbation", "scaled_by_signs", "RunResult"]

AMBIENT = "ambient"  # leave autocast as the live call had it (teacher forcing runs inside the target's forward)


class ProbeSkip(Exception):
    """This call cannot be rerun faithfully; the message says why (it goes into `/unprobed`)."""


@dataclass(frozen=True)
class Site:
    """Where, and in which precision, one rerun happens.

    `cast`: `live` (every tensor in the dtype it had in the live call), `source` (as the source stored it: the
    reference's own precision), or a dtype name (every floating tensor in that dtype).
    `params`: `live` (the module's own parameters, cast per `cast`) or `reference` (the reference's state_before).
    `trusted`: a trusted recomputation; `--inject-fault` faults and `--fallback` step aside, ops whose CPU kernels are
    not torch's own run through torch's (see `trusted.py`).
    `perturb`: (seed, unit roundoff) of a Monte Carlo sample: every floating value read is perturbed
    (`Perturbation`; only where `live` is False: a live rerun uses the module's own weights).
    `reduced`: (family, mode) pairs of the float32 ops the run it stands for ran reduced (TF32 convolutions): their
    operands are rounded to that mode (`reduced.py`); empty: float32 as it is.
    `inject`: (seed, roundoff, accumulate, families) of a run with a lower precision's rounding injected into every
    op's result (`modes/roundoff_mode.py`: the bound a noise estimate is checked against); None: none.
    """

    name: str
    device: Any
    live: bool
    cast: str
    autocast: Any  # a torch dtype, None for no autocast, or AMBIENT
    params: str
    trusted: bool
    perturb: tuple[int, float] | None = None
    reduced: tuple = ()
    inject: tuple | None = None

    def dtype_for(self, live_dtype, stored_dtype):
        if self.cast == "live":
            return live_dtype
        if self.cast == "source":
            return stored_dtype
        return getattr(torch, self.cast)


class Perturbation:
    """The random relative perturbation of a Monte Carlo sample: each floating value x becomes x * (1 + s * eps),
    s a random sign, eps = 2u for the unit roundoff u of the run's precision or of x's dtype (the coarser): about
    one unit in the last place of the precision the value is computed in, in a random direction. Computed in x's
    dtype (float32 at least, never float64: the devices this is for may have none). The signs come from numpy's
    generator seeded per sample (reproducible, and no torch random op the rerun's replay of recorded random ops
    would take for the model's). `Perturbation(None)` changes nothing."""

    def __init__(self, spec: tuple[int, float] | None):
        self.roundoff = spec[1] if spec else 0.0
        self.generator = np.random.default_rng(int(spec[0])) if spec else None

    def __call__(self, tensor):
        if self.generator is None or not tensor.is_floating_point() or tensor.numel() == 0:
            return tensor
        eps = 2.0 * max(self.roundoff, unit_roundoff(str(tensor.dtype)))
        sign = torch.from_numpy(self.generator.integers(0, 2, size=tuple(tensor.shape), dtype=np.int8))
        return scaled_by_signs(tensor, sign, eps)


def scaled_by_signs(tensor, signs, eps: float):
    """`tensor` * (1 + eps) where `signs` is 1 and * (1 - eps) where it is 0, computed in the tensor's dtype widened
    to float32 at least and stored in its dtype (`Perturbation`, and the twin of a multi-step replay)."""
    work = torch.promote_types(tensor.dtype, torch.float32)
    factor = signs.to(device=tensor.device, dtype=work) * (2.0 * eps) + (1.0 - eps)  # 1 - eps or 1 + eps
    with torch.no_grad():
        return (tensor.to(work) * factor).to(tensor.dtype)



@dataclass(frozen=True)
class RunResult:
    """What one rerun produced, by local-table name: a value, built once by `Rerunner.run`.

    `forward`: the call's outputs and the inputs it handed each forced child; `backward`: the gradients w.r.t. its
    inputs and w.r.t. each forced child's outputs. `passed_on`: the (phase, name)s that merely pass on a value
    handed in (a forced child's output given to the next child): nothing of the call's own code is in those.
    `grad_contributions`: canonical parameter name -> this call's own contribution to its gradient;
    `changed_buffers`: canonical buffer name -> its value after the call, for the buffers the call changed
    (BatchNorm's running statistics)."""

    forward: dict
    backward: dict
    passed_on: set
    grad_contributions: dict = field(default_factory=dict)
    changed_buffers: dict = field(default_factory=dict)
    internal_grads: dict = field(default_factory=dict)
    """grad name -> the part of an output's recorded gradient that came from the call itself, for outputs the
    call also consumed (a model returning both `logits` and the `loss` computed from them)."""
