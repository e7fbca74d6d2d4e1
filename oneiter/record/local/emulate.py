"""A low-precision recipe's exact emulation: what a correct kernel of the recipe gives, computed by oneiter.

Where this sits: for a call that runs a recipe of the table (`recipes.py`), `recipe_rows.py` hands this module the
reference's recorded input, weight, bias and output gradient (in the dtypes the target's call held them) and gets,
for every tensor the call produces, an `Emulated` value. Everything here is float64 arithmetic of oneiter's own on
the CPU: the recipe's scales (`amax` of each operand, per tensor, row or block), its casts (`formats.round_to`, never a
cast kernel), exact products of the quantized elements and exact sums, then the recipe's roundings of the result.
Nothing of the target's code or kernels runs (docs/blame.md, "never calibrate with what is under test").

**What a correct kernel may differ by: its accumulation.** A scaled matrix product sums K products in float32 (or,
with CUDA's fast accumulation, in about 14 bits: DeepSeek-V3's report; `ACCUMULATOR`), in an order of its own. Per
element of the result the emulation carries that accumulation's scale `sigma = u_acc * sqrt(K) * ||terms||_2`
(above the typical error of a float32 sum in any order: recursive summation gives about a third of it, blocked and
pairwise sums less). The call's expected noise is ||sigma|| / ||exact||.

Where the recipe rounds its result to a format coarser than its accumulator (torchao's rowwise kernel returns
bfloat16; a bfloat16 model's output), a correct kernel may round an element whose exact value lies near a rounding
boundary to either neighbour: one unit of bfloat16 where the accumulation is a ten-millionth of it. So each element
gets the interval of results a correct kernel can give, [R(v - w), R(v + w)] with w = `WINDOW` x sigma and R the
recipe's roundings (each monotone), and the *deviation* counts only the distance of the target's value from that
interval. Without such a rounding the interval is the point R(v), and the deviation is the plain difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oneiter.record.local.formats import round_to
from oneiter.record.local.recipes import Cast, Gemm
from oneiter.record.modes.casts import scaled_mm_exact
from oneiter.runtime.precision import unit_roundoff

__all__ = ["Emulated", "ACCUMULATOR", "WINDOW", "accumulator", "linear", "quantize", "EPS", "scaled_mm"]

EPS = 1e-12  # torchao's floor of a float8 operand's largest magnitude (float8_utils.EPS): an all-zero tensor's scale
WINDOW = 8.0  # how many accumulation sigmas around the exact value a correct kernel's result may lie before rounding
ACCUMULATOR = {"default": unit_roundoff("float32"), "fast_accum": 2.0 ** -14}
"""The unit roundoff of a scaled product's accumulator: float32's, or CUDA FP8 fast accumulation's (about 14
significant bits, DeepSeek-V3's report; not measured here: `bench/float8_costs.py` measures it on a CUDA machine)."""
_F32 = "float32"


@dataclass
class Emulated:
    """A tensor as the recipe computes it: `center` (the exact product rounded as the recipe rounds it), the
    interval `lo`..`hi` a correct kernel's result lies in (equal to `center` where the recipe rounds to nothing
    coarser than its accumulator), and `sigma`, the accumulation's scale per element (module docstring). All float64
    on the CPU, in the target tensor's shape."""

    center: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    sigma: torch.Tensor

    def reshape(self, *shape) -> Emulated:
        return Emulated(*(t.reshape(*shape) for t in (self.center, self.lo, self.hi, self.sigma)))

    def __add__(self, other: Emulated) -> Emulated:
        """Two calls' contributions to one parameter's gradient, summed (as autograd accumulates them)."""
        return Emulated(self.center + other.center, self.lo + other.lo, self.hi + other.hi,
                        torch.sqrt(self.sigma ** 2 + other.sigma ** 2))

    @classmethod
    def exact(cls, value: torch.Tensor) -> Emulated:
        """A value taken as it is (no recipe: a mixed parameter's other contributions)."""
        v = value.detach().to("cpu", torch.float64)
        return cls(v, v, v, torch.zeros_like(v))

    def norm(self) -> float:
        finite = self.center[torch.isfinite(self.center)]
        return float(torch.linalg.vector_norm(finite))

    def noise(self) -> float:
        """The accumulation's expected rel_l2: ||sigma|| / ||center||."""
        norm = self.norm()
        return float(torch.linalg.vector_norm(self.sigma)) / norm if norm else 0.0

    def deviation(self, value: torch.Tensor) -> float:
        """rel_l2 of the distance of `value` from the interval a correct kernel's result lies in (0 inside it);
        inf where it is non-finite and the emulation is not (or the other way round)."""
        v = value.detach().to("cpu", torch.float64).reshape(self.center.shape)
        finite = torch.isfinite(self.center)
        if not torch.equal(finite, torch.isfinite(v)):
            return math.inf
        distance = (v - torch.minimum(torch.maximum(v, self.lo), self.hi))[finite]
        norm = self.norm()
        diff = float(torch.linalg.vector_norm(distance))
        return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def accumulator(gemm: Gemm, device_type: str) -> float:
    """The unit roundoff a correct kernel of `gemm` accumulates in on `device_type` (fast accumulation counts on
    CUDA only: torch's CPU kernel ignores it)."""
    return ACCUMULATOR["fast_accum" if gemm.fast_accum and device_type == "cuda" else "default"]


def quantize(x: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, scale) of a 2-D operand whose contracted dimension is its last: x ~ elements / scale (`amax`
    rules) or elements * scale (`e8m0` rules, the block's power of two). `x` is float64 holding its dtype's values."""
    if cast.scaling == "block":
        return _quantize_blocks(x, cast)
    amax = x.abs().amax() if cast.scaling == "tensor" else x.abs().amax(dim=-1, keepdim=True)
    largest = float(torch.finfo(getattr(torch, cast.element)).max)
    # torchao: max / clamp(amax, EPS) in float64, then float32 (float8_utils.amax_to_scale)
    scale = round_to(largest / torch.clamp(amax, min=EPS), _F32)
    if cast.pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = round_to(round_to(x, _F32) * scale, _F32)  # tensor.to(float32) * scale, in float32
    return round_to(torch.clamp(scaled, -largest, largest), cast.element), scale


def _quantize_blocks(x: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """MX: blocks of `cast.block` along the last dimension, each with an e8m0 (power of two) scale: torchao's
    `to_mx` (RCEIL: 2^ceil(log2(amax / max)); FLOOR: 2^(floor(log2 amax) - the element's largest exponent))."""
    rows, cols = x.shape
    if cols % cast.block:
        raise ValueError(f"MX blocks of {cast.block} need a contracted dimension divisible by it, got {cols}")
    blocks = round_to(x, _F32).reshape(rows, cols // cast.block, cast.block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    largest = float(torch.finfo(getattr(torch, cast.element)).max)
    if cast.rule == "e8m0_rceil":
        descale = round_to(amax / largest, _F32)
        exponent = torch.clamp(torch.ceil(torch.log2(descale)), -127, 127)
        # a biased exponent of 0 (all-zero blocks, or descale <= 2^-127): torchao multiplies by 1 instead
        factor = torch.where(exponent == -127, torch.ones_like(amax), torch.exp2(-exponent))
        elements = round_to(torch.clamp(round_to(blocks * factor, _F32), -largest, largest), cast.element)
    else:
        top = math.floor(math.log2(largest))  # the element format's largest power of two (e4m3: 8)
        _, exp = torch.frexp(amax)
        # the exponent field of float32 amax: floor(log2 amax), -127 for zero and subnormals
        field = torch.where(amax < 2.0 ** -126, torch.full_like(amax, -127.0), exp.to(torch.float64) - 1)
        exponent = torch.clamp(field - top, -127, 128)
        divisor = torch.clamp(torch.exp2(exponent), min=2.0 ** -126)
        elements = round_to(torch.clamp(round_to(blocks / divisor, _F32), -largest, largest), cast.element)
    return elements.reshape(rows, cols), torch.exp2(exponent).expand_as(blocks).reshape(rows, cols)


def _operand(x: torch.Tensor, cast: Cast | None, gemm: Gemm, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the operand's values as the product multiplies them, the scale still to apply to each row of it: 1 where
    dequantizing is part of the values) of a 2-D operand contracted along its last dimension."""
    ones = torch.ones((x.shape[0], 1), dtype=torch.float64)
    if cast is None:
        return x, ones
    elements, scale = quantize(x, cast)
    if gemm.dequant == "blocks":  # MX emulated: element * 2^e in the operand's own dtype, then a plain product
        return round_to(elements * scale, dtype), ones
    if gemm.dequant == "divided":  # torchao's `emulate`: data.float() / scale, in float32
        return round_to(elements / scale, _F32), ones
    inverse = round_to(1.0 / scale, _F32)  # scale.reciprocal(), in float32
    return elements, inverse.expand(x.shape[0], 1) if inverse.dim() < 2 or inverse.shape[0] == 1 else inverse


def product(a: torch.Tensor, b: torch.Tensor, gemm: Gemm, dtype: str, u_acc: float,
            bias: torch.Tensor | None = None) -> Emulated:
    """`a @ b^T` as the recipe computes it (`a`: M x K, `b`: N x K, both contracted along K, float64 holding the
    values of `dtype`, the product's output dtype), rounded as its kernel rounds it, plus `bias` (added in `dtype`,
    as torchao's Linears add it)."""
    qa, sa = _operand(a, gemm.a, gemm, dtype)
    qb, sb = _operand(b, gemm.b, gemm, dtype)
    exact = qa @ qb.T
    k = a.shape[1]
    sigma = u_acc * math.sqrt(k) * torch.sqrt((qa * qa) @ (qb * qb).T)
    scales = sa * sb.T  # (M, N): each element's inverse scales (1 where the values hold them)
    steps: list[tuple[str, torch.Tensor | str]] = []
    if gemm.post_scaled:  # torchao's rowwise kernel without fast accumulation: scaled after rounding, in bfloat16
        steps += [("round", gemm.inter), ("mul", round_to(scales, _F32)), ("round", gemm.inter)]
        sigma_out = sigma * scales
    else:
        exact, sigma = exact * scales, sigma * scales
        sigma_out = sigma
        if gemm.inter or gemm.dequant == "divided":  # rowwise: bfloat16 first; `emulate`: torch.mm in float32
            steps.append(("round", gemm.inter or _F32))
    steps.append(("round", dtype))
    if bias is not None:
        steps += [("add", bias.reshape(1, -1)), ("round", dtype)]
    coarse = any(kind == "round" and isinstance(arg, str) and unit_roundoff(arg) > u_acc for kind, arg in steps)
    width = WINDOW * sigma if coarse else torch.zeros_like(sigma)
    return Emulated(_apply(exact, steps), _apply(exact - width, steps), _apply(exact + width, steps), sigma_out)


def scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, *,
              device_type: str = "cpu") -> Emulated | None:
    """One `torch._scaled_mm` as a correct kernel gives it (`replay --ops` judges the op by this): the exact scaled
    product plus bias, rounded to its output dtype, with the interval and the accumulation's sigma as a recipe's
    product has them; None where `casts.scaled_mm_exact` does not apply (block scales, a result scale)."""
    exact = scaled_mm_exact(mat1, mat2, scale_a, scale_b, bias, scale_result)
    if exact is None:
        return None
    a, b = mat1.double(), mat2.double()
    scales = (scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)).abs()
    u_acc = ACCUMULATOR["fast_accum" if use_fast_accum and device_type == "cuda" else "default"]
    sigma = u_acc * math.sqrt(a.shape[1]) * torch.sqrt((a * a) @ (b * b)) * scales
    dtype = str(out_dtype or mat1.dtype).removeprefix("torch.")
    width = WINDOW * sigma if unit_roundoff(dtype) > u_acc else torch.zeros_like(sigma)
    return Emulated(round_to(exact, dtype), round_to(exact - width, dtype), round_to(exact + width, dtype), sigma)


def _apply(value: torch.Tensor, steps: list) -> torch.Tensor:
    for kind, arg in steps:
        value = round_to(value, arg) if kind == "round" else value * arg if kind == "mul" else value + arg
    return value


def column_sum(g: torch.Tensor, dtype: str, u_acc: float) -> Emulated:
    """A bias's gradient: the output gradient summed over its rows, exactly, rounded to `dtype`."""
    exact = g.sum(dim=0)
    sigma = u_acc * math.sqrt(g.shape[0]) * torch.linalg.vector_norm(g, dim=0)
    coarse = unit_roundoff(dtype) > u_acc
    width = WINDOW * sigma if coarse else torch.zeros_like(sigma)
    return Emulated(round_to(exact, dtype), round_to(exact - width, dtype), round_to(exact + width, dtype), sigma)


def linear(recipe, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor | None,
           dtypes: dict[str, str], device_type: str) -> dict[str, Emulated]:
    """A Linear call under `recipe`: its output, and with an output gradient `grad` its input's and parameters'
    gradients, by role (`output`, `grad_input`, `weight`, `bias`). Tensors are float64 holding the values the call
    held (`x` any shape ending in K, `weight` N x K); `dtypes` names the dtype of each role's result."""
    x2 = x.reshape(-1, x.shape[-1])
    out = product(x2, weight, recipe.forward, dtypes["output"], accumulator(recipe.forward, device_type), bias)
    found = {"output": out.reshape(*x.shape[:-1], weight.shape[0])}
    if grad is None:
        return found
    g2 = grad.reshape(-1, grad.shape[-1])
    found["grad_input"] = product(g2, weight.T, recipe.grad_input, dtypes["grad_input"],
                                  accumulator(recipe.grad_input, device_type)).reshape(x.shape)
    found["weight"] = product(g2.T, x2.T, recipe.grad_weight, dtypes["weight"],
                              accumulator(recipe.grad_weight, device_type))
    if bias is not None:
        found["bias"] = column_sum(g2, dtypes["bias"], ACCUMULATOR["default"])
    return found
