"""The rounding a precision adds to one op, for injecting into a float64 computation (Monte Carlo arithmetic).

Where this sits: two parts of the calibration need what a precision *can* produce without running that precision's
kernels:
- the plausibility bound of a call's noise (`record/local/probe.py`, `record/modes/roundoff_mode.py`): the call rerun in
  float64 on the CPU with torch's kernels, every op's arithmetic perturbed as a correct kernel of the run's
  precision could have rounded it; the spread of such runs around the plain float64 run is what the precision
  produces for that call, its condition included (an amplifying backward amplifies the perturbations too);
- the float64 route of an op whose CPU kernel is not torch's own and that no kernel of torch's can stand for
  (`record/modes/trusted.py`): its float64 result perturbed the same way, then rounded to the op's dtype.

**How much** (`inject`). Each floating input of an op is multiplied by (1 ± δ) at random per element, δ = u +
sqrt(L - 1) u_acc, the rounding a sum of L terms accumulates (the terms summed into each element: a matmul's
contracted dimension, a convolution's input channels times kernel size, the reduced elements of a sum or a
normalisation; random rounding errors grow like sqrt(L)), and each floating result by (1 ± δ) with the L of that
result (`result_delta`; 1 for an elementwise result: one rounding). On the *terms* the accumulation error makes a
sum that cancels (a bias gradient after a normalisation, whose terms sum to almost nothing) lose as many digits as
float32 loses; on the *result* it covers a sum of terms of one sign, whose partial sums grow as it goes and round
alike (a bias's gradient summing the one value a mean's backward broadcast: 83 u over 768 terms in float32 on 2
threads, where terms perturbed at random gave u). u_acc is the accumulator's roundoff: float32's under bf16/fp16
(kernels accumulate in float32), the run's own otherwise, and the run's own for a normalisation's results
(`result_delta`: torch's CPU LayerNorm backward sums its weight's and bias's gradients in bf16).
"""

from __future__ import annotations

import math

__all__ = ["UNANNOTATED_WRITES", "reduction_length", "result_delta", "delta", "perturbed_", "inject", "meta_outputs"]

_CONTRACT_LAST = {"mm": 0, "bmm": 0, "matmul": 0, "linear": 0, "mv": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1,
                  "addmv": 1, "_grouped_mm": 0}  # op -> the argument whose last dimension is contracted
_ALONG_DIM = {"_softmax": 1, "_log_softmax": 1, "_softmax_backward_data": 2, "_log_softmax_backward_data": 2,
              "cumsum": 1, "cumprod": 1, "logcumsumexp": 1}  # op -> the position of its `dim` argument
_NORMS = ("native_layer_norm", "native_batch_norm", "_native_batch_norm", "native_group_norm", "batch_norm",
          "layer_norm", "group_norm", "_fused_rms_norm", "rms_norm", "cudnn_batch_norm")


# arguments kernels update in place without their schema saying so: `native_batch_norm`, `cudnn_batch_norm`,
# `miopen_batch_norm` write a training call's running statistics into the tensors they are handed. A copy of them
# (what an unwritten input gets) would leave the module's buffers where they were: a bound measured on such runs
# saw BatchNorm's running statistics never move (rel_l2 1.0 against the float64 run's update, whatever it was).
UNANNOTATED_WRITES = {op: frozenset({"running_mean", "running_var"})
                      for op in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")}


def reduction_length(func, args: tuple, outputs: list, out=None) -> int:
    """How many terms an op sums into each element of its result (1 for an elementwise op). `out`: of that one
    result of the op: the op's length where every result element sums alike (a contraction, a convolution, a
    dimension of a softmax or a cumulative sum); else the op's largest input per element of `out` (a sum's, a mean's;
    a normalisation's statistics and its weight's and bias's gradients, while its input's gradient is 1)."""
    name = func.overloadpacket.__name__
    tensors = [a for a in args if hasattr(a, "shape") and hasattr(a, "numel")]
    if name in _CONTRACT_LAST and len(args) > _CONTRACT_LAST[name]:
        operand = args[_CONTRACT_LAST[name]]
        return max(1, int(operand.shape[-1])) if getattr(operand, "dim", lambda: 0)() else 1
    if name in ("dot", "vdot"):
        return max(1, int(args[0].numel()))
    if name == "convolution" and len(args) > 1:
        weight = args[1]
        return max(1, int(weight[0].numel()) if weight.dim() else 1)
    if name == "convolution_backward" and len(args) > 2:
        grad, weight = args[0], args[2]
        per_input = int(weight.shape[0]) * int(math.prod(weight.shape[2:])) if weight.dim() > 1 else 1
        per_weight = int(grad.numel() // max(1, grad.shape[1])) if grad.dim() > 1 else 1
        return max(1, per_input, per_weight)
    if name in _ALONG_DIM and len(args) > _ALONG_DIM[name] and tensors:
        dim = args[_ALONG_DIM[name]]
        shape = tensors[0].shape
        return max(1, int(shape[dim])) if isinstance(dim, int) and shape else 1
    sizes = [int(t.numel()) for t in tensors]
    if out is not None:
        return max(1, max(sizes, default=1) // max(1, int(out.numel())))
    produced = [int(t.numel()) for t in outputs if t is not None and hasattr(t, "numel") and t.numel()]
    if not sizes or not produced:
        return 1
    if name.startswith(_NORMS):  # the statistics (the smallest output) reduce the input
        return max(1, max(sizes) // max(1, min(produced)))
    return max(1, max(sizes) // max(produced))


def result_delta(func, args: tuple, outputs: list, out, roundoff: float, accumulate: float) -> float:
    """The relative perturbation of one result `out` of an op (`delta` with its `reduction_length`). A normalisation's
    results are summed in the run's own precision at worst, not in `accumulate`'s: torch's CPU LayerNorm backward
    sums its weight's and bias's gradients over the rows in bf16 (1.1 % off float64 on the same rounded inputs over
    512 rows, where GroupNorm's, BatchNorm's and a bf16 `sum` are 0.16 %: the rounding of their float32 sums)."""
    acc = max(roundoff, accumulate) if func.overloadpacket.__name__.startswith(_NORMS) else accumulate
    return delta(roundoff, acc, reduction_length(func, args, outputs, out))


def delta(roundoff: float, accumulate: float, length: int) -> float:
    """The relative perturbation of an op's terms that stands for its rounding (module docstring)."""
    return roundoff + math.sqrt(max(1, length) - 1) * accumulate


def perturbed_(tensor, eps: float, rng):
    """`tensor` * (1 ± eps) in place, the sign drawn per element from the numpy generator `rng`; returns it."""
    import numpy as np
    import torch

    if eps <= 0 or tensor.numel() == 0 or not tensor.is_floating_point():
        return tensor
    signs = torch.from_numpy(rng.integers(0, 2, size=tuple(tensor.shape), dtype=np.int8))
    factor = signs.to(device=tensor.device, dtype=tensor.dtype) * (2.0 * eps) + (1.0 - eps)
    with torch.no_grad():
        return tensor.mul_(factor)


def meta_outputs(func, args: tuple, kwargs: dict, keep_none: bool = False) -> list | None:
    """The op's outputs on the meta device (shapes, strides, dtypes; `keep_none`: with None for the outputs it does
    not compute, as `convolution_backward` for a mask); None where it has no meta kernel."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    def meta(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        return x

    try:
        out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    except Exception:  # noqa: BLE001 - no meta kernel: the caller does without
        return None
    if keep_none and isinstance(out, (tuple, list)):
        return [t if isinstance(t, torch.Tensor) else None for t in out]
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def inject(func, args: tuple, kwargs: dict, roundoff: float, accumulate: float, rng,
           operand: float = 0.0) -> tuple[tuple, dict]:
    """The op's arguments with their floating inputs perturbed (module docstring: δ, or `operand` where larger, the
    roundoff of a reduced mode the op's operands were rounded to): copies, except an argument the op writes into
    (perturbed in place, as the value it updates)."""
    import torch

    like = meta_outputs(func, args, kwargs) or []
    eps = max(delta(roundoff, accumulate, reduction_length(func, args, like)), operand)
    written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    written |= UNANNOTATED_WRITES.get(func.overloadpacket.__name__, frozenset())
    names = [a.name for a in func._schema.arguments]

    def one(value, name: str):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
            return value
        if name in written:
            return value if name in kwargs else perturbed_(value, eps, rng)  # an out= argument holds no input
        return perturbed_(value.clone(), eps, rng)

    new_args = tuple(one(a, names[i] if i < len(names) else "") for i, a in enumerate(args))
    new_kwargs = {k: one(v, k) if not isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
    return new_args, new_kwargs
