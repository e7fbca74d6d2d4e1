"""The gradients as the optimizer step sees them: clipping (and unscaling) between backward and the step, judged.

Training loops change the gradients in place after backward: `clip_grad_norm_` (the Trainer's default
`max_grad_norm=1.0`, Lightning's `gradient_clip_val`, torchtitan's loop) scales every gradient by one coefficient,
`min(1, max_norm / (total_norm + 1e-6))`, from the total norm of all of them; a GradScaler's `unscale_` by `1 / scale`
(the file's gradients are already unscaled: coefficient 1 relative to them). The step then sees those gradients, not
the ones backward left. Where this sits: the session measures each gradient's norm when backward is done
(`squared_norms`) and, when the step finds the gradients changed, stores them as the step sees them
(`/step_grads`, with the figures of `step_figures` as the group's attributes); the teacher-forced probe judges the
change as its own entry (`clip_row`) and steps the optimizer from the reference's `/step_grads`
(`optimizer_rows.py`), so the update is judged like any other.

The clipping is judged on the target's own recorded gradients, against float64: their total norm N (float64, of the
gradients backward left, as the file holds them), the reference's `max_norm` M (its coefficient times its own
float64 total norm: M = c_ref (N_ref + 1e-6), read where the reference's clipping was active), so the coefficient
the target's clipping should have applied is `min(1, M / (N + 1e-6))`; each parameter's own coefficient (the norm
of what the step saw over the norm of what backward left) is held to it. Its error is the largest relative
difference; its expected noise the rounding of the two total norms in the gradients' dtype, each a sum of squares
of L terms (u (1 + sqrt(L - 1)) for the largest tensor and again for the sum over tensors), the project's model of
an accumulation (`runtime/roundoff.py`). A clipping whose total norm is 1 % off is 1e-2 off, named as the clipping;
a reference whose clipping was not active (coefficient 1) says only that M >= N_ref: the target's coefficient is
then held to `min(1, M / N)` for the smallest such M (the error is how far its implied max_norm falls below N_ref).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from oneiter.format.schema import CLIP_ROW, OPTIMIZER_MODULE
from oneiter.record.local.rows import JudgedRow, dtype_name
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.sharding import is_dtensor

__all__ = ["CLIP_ROW", "OPTIMIZER_MODULE", "squared_norms", "step_figures", "clip_row", "EPS"]

EPS = 1e-6  # torch's clip_grad_norm_: max_norm / (total_norm + 1e-6)
ONE_COEFFICIENT_ULPS = 8.0  # per-parameter coefficients of one clipping agree within this many unit roundoffs


def squared_norms(named) -> Optional[dict[str, float]]:
    """name -> the squared L2 norm (float64) of each gradient in `named` ((name, tensor) pairs); None when one is
    sharded (a DTensor: this rank's shard is no total)."""
    found = {}
    for name, grad in named:
        if is_dtensor(grad):
            return None
        found[name] = _squared(grad)
    return found


def _squared(grad) -> float:
    """The squared L2 norm in float64, computed where the gradient lives, out of sight of the user's dispatch modes."""
    import torch  # not at import: the session imports this, and `import oneiter` imports no torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return float(torch.linalg.vector_norm(grad.detach(), dtype=torch.float64)) ** 2


def step_figures(before: dict[str, float], named) -> dict[str, Any]:
    """The figures of the gradients as the step sees them (`named`: (name, tensor)) against their squared norms after
    backward (`before`): `coefficient` (the norm of all of them over the norm of all before; NaN when the parameters'
    own coefficients differ by more than one clipping's rounding: no single coefficient), `grad_norm`, `step_norm`
    (float64 total norms), `spread` (the largest relative difference of a parameter's own coefficient from it),
    `largest` (the most elements of one gradient) and `dtype` (the gradients' coarsest dtype)."""
    after, own, largest, dtype = {}, {}, 1, "float64"
    for name, grad in named:
        after[name] = _squared(grad)
        if before.get(name):
            own[name] = math.sqrt(after[name] / before[name])
        largest = max(largest, grad.numel())
        if unit_roundoff(dtype_name(grad.dtype)) > unit_roundoff(dtype):
            dtype = dtype_name(grad.dtype)
    grad_norm = math.sqrt(sum(before.get(n, 0.0) for n in after))
    step_norm = math.sqrt(sum(after.values()))
    coefficient = step_norm / grad_norm if grad_norm else math.nan
    spread = max((abs(c - coefficient) / coefficient for c in own.values()), default=0.0) if coefficient else 0.0
    if not spread <= ONE_COEFFICIENT_ULPS * unit_roundoff(dtype):
        coefficient = math.nan
    return {"coefficient": coefficient, "grad_norm": grad_norm, "step_norm": step_norm, "spread": spread,
            "largest": largest, "count": len(after), "dtype": dtype, "own": own}


def clip_row(reference: dict[str, Any], target: dict[str, Any]) -> tuple[Optional[JudgedRow], str]:
    """The clipping's /local row (`CLIP_ROW`), or None and why it cannot be judged. `reference`: the attributes of the
    reference's `/step_grads` (`step_figures` as stored); `target`: this run's `step_figures` (coefficient 1 and
    `own` empty when its gradients did not change)."""
    c_ref, n_ref = float(reference.get("coefficient", math.nan)), float(reference.get("grad_norm", math.nan))
    if not (math.isfinite(c_ref) and math.isfinite(n_ref)):
        return None, ("the reference's step saw its gradients changed by no single coefficient (not a norm "
                      "clipping): that change is not judged; the update is judged from the reference's step gradients")
    n_t = float(target["grad_norm"])
    if c_ref < 1.0:  # active: max_norm is known
        expected = min(1.0, c_ref * (n_ref + EPS) / (n_t + EPS))
    else:  # inactive: max_norm >= n_ref, so the coefficient is at least min(1, n_ref / n_t)
        expected = min(1.0, (n_ref + EPS) / (n_t + EPS))
    coefficients = list(target["own"].values()) or [target["coefficient"] if target["own"] else 1.0]
    if c_ref >= 1.0:  # any coefficient above the least max_norm allows is consistent with it
        coefficients = [c if c < expected else expected for c in coefficients]
    error = max(abs(c - expected) for c in coefficients) / expected if expected else math.inf
    stats = {"numel": 1, "rel_l2": error, "max_abs": error * expected, "cosine": 1.0, "nan_ref": 0, "inf_ref": 0,
             "nan": 0, "inf": 0, "mismatch": 0}
    u = unit_roundoff(str(target["dtype"]))
    accumulated = u * (1 + math.sqrt(max(int(target["largest"]), 1) - 1)) + u * (1 + math.sqrt(
        max(int(target["count"]), 1) - 1))
    row = JudgedRow(OPTIMIZER_MODULE, 0, "optimizer", CLIP_ROW, str(target["dtype"]), stats, at=0)
    row.noise_target = row.noise_reference = accumulated
    row.calibration = "model"  # the rounding of two norms, modelled: no rerun of the user's clipping exists
    return row, ""
