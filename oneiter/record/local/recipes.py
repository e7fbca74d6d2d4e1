"""The recipe table: low-precision training recipes oneiter knows, read from the target's module, one row each.

Where this sits: the probe (`probe.py`) asks `recipe_of(module)` for every call it judges. A call that runs a known
recipe — its Linear's matrix products take float8 (or MX block) operands with scales the recipe computes — is not
calibrated by rerunning its code in float64 (that code casts to float8 in float64 too, so the format's rounding would
be invisible to the calibration and every such call flagged). It is judged against the recipe's exact emulation
instead (`emulate.py`), computed by oneiter from the reference's recorded inputs and weights and what this table
reads from the module: its scales, casts and roundings, never by running the target's code or kernels.

A recipe is three matrix products (`Gemm`), those of a Linear's forward and backward:

    forward      output      = input       @ weight^T     (M x K) @ (K x N)
    grad_input   grad_input  = grad_output @ weight       (M x N) @ (N x K)
    grad_weight  grad_weight = grad_output^T @ input      (N x M) @ (M x K)

each operand quantized by a `Cast` (element format, one scale per tensor, per row or per block along the
contracted dimension, how the scale is computed) or left in high precision (None), and the product rounded as the
recipe's kernel rounds it (`Gemm.inter`: torchao's rowwise kernel returns bfloat16 before the float32 output).

**Rows** (`RECIPES`, first match wins; a new recipe is a reader here and, where its arithmetic is new, a case in
`emulate.py`):
- `torchao.float8`: `torchao.float8.Float8Linear` (what `convert_to_float8_training` and torchtitan's `float8`
  converter swap in): every cast config read from `module.config` (`tensorwise`, `rowwise`, `rowwise_with_gw_hp` and
  any combination), `round_scales_to_power_of_2`, `use_fast_accum` per product, `emulate`.
- `torchao.mxfp8`: torchao's MX training (`MXFP8Linear`, or an `nn.Linear` whose weight is an
  `MXFP8TrainingWeightWrapperTensor`) with `kernel_preference=EMULATED` (the one that runs on a CPU): blocks of 32
  along the contracted dimension, e8m0 scales (RCEIL or FLOOR), `wgrad_with_hp`.

Not in the table: Transformer Engine (`fp8_autocast`): it is not installable here, so no row could be checked against
it (docs/blame.md says what a call of it gets); torchao MX's `AUTO` kernels (CUTLASS, SM100 only).
Reading a module never imports torchao: the table matches class names and reads plain attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Cast", "Gemm", "Recipe", "RECIPES", "recipe_of", "GEMMS"]

GEMMS = ("forward", "grad_input", "grad_weight")


@dataclass(frozen=True)
class Cast:
    """How one operand of a product is quantized: its `element` format (a torch dtype name), one scale per `tensor`,
    per `row` (along the contracted dimension: a row of the left operand, a column of the right one) or per `block`
    of `block` elements along it, computed by `rule`: `amax` (the element format's largest value / the operand's
    largest magnitude, in float32; `pow2`: rounded down to a power of two), `e8m0_rceil` / `e8m0_floor` (MX)."""

    element: str
    scaling: str
    rule: str
    pow2: bool = False
    block: int = 0

    def describe(self) -> str:
        short = self.element.removeprefix("float8_").replace("fn", "")
        return f"{short} {self.scaling}" + (f" {self.block}" if self.block else "")


@dataclass(frozen=True)
class Gemm:
    """One matrix product of a recipe. `a`, `b`: the operands' casts (None: high precision). `dequant`: `scaled` (a
    scaled matrix product: exact products of the elements, times the inverse scales), `divided` (torchao's
    `emulate`: each operand divided by its scale in float32 first) or `blocks` (MX emulated: each operand times its
    block scale in its own dtype, then a plain product). `inter`: the dtype the kernel rounds the product to before
    the output's (torchao's rowwise kernel: bfloat16), or "". `post_scaled`: the scales are applied after that
    rounding, in it (torchao's rowwise without fast accumulation). `fast_accum`: the kernel's fast accumulation
    (CUDA's FP8 tensor cores then accumulate in fewer bits)."""

    a: Optional[Cast]
    b: Optional[Cast]
    dequant: str = "scaled"
    inter: str = ""
    post_scaled: bool = False
    fast_accum: bool = False


@dataclass(frozen=True)
class Recipe:
    """A module's low-precision recipe: its `name` (`torchao.float8 rowwise`), the `format` reports name it by
    (`float8`, `mxfp8`) and its three products."""

    name: str
    format: str
    forward: Gemm
    grad_input: Gemm
    grad_weight: Gemm

    def gemm(self, which: str) -> Gemm:
        return getattr(self, which)


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


def _torchao_cast(config, which: str, pow2: bool) -> Optional[Cast]:
    cast = getattr(config, which)
    if _enum_name(cast.scaling_type) == "DISABLED":
        return None
    if _enum_name(cast.scaling_type) != "DYNAMIC":
        raise ValueError(f"torchao scaling type {cast.scaling_type} is not in the recipe table")
    granularity = _enum_name(cast.scaling_granularity)
    scaling = {"TENSORWISE": "tensor", "AXISWISE": "row"}.get(granularity)
    if scaling is None:
        raise ValueError(f"torchao scaling granularity {granularity} is not in the recipe table")
    return Cast(str(cast.target_dtype).removeprefix("torch."), scaling, "amax", pow2)


def _torchao_gemm(config, a: str, b: str, accum: str) -> Gemm:
    pow2 = bool(getattr(config, "round_scales_to_power_of_2", False))
    cast_a, cast_b = _torchao_cast(config, a, pow2), _torchao_cast(config, b, pow2)
    fast = bool(getattr(getattr(config, accum), "use_fast_accum", False))
    if cast_a is None or cast_b is None:
        return Gemm(None, None, fast_accum=False)
    if bool(getattr(config, "emulate", False)):
        return Gemm(cast_a, cast_b, dequant="divided")
    rowwise = "row" in (cast_a.scaling, cast_b.scaling)  # torchao repeats a tensorwise scale into a row then
    return Gemm(cast_a, cast_b, inter="bfloat16" if rowwise else "", post_scaled=rowwise and not fast,
                fast_accum=fast)


def _torchao_float8(module) -> Optional[Recipe]:
    cls = type(module)
    if cls.__name__ != "Float8Linear" or not cls.__module__.startswith("torchao."):
        return None
    config = module.config
    gemms = (_torchao_gemm(config, "cast_config_input", "cast_config_weight", "gemm_config_output"),
             _torchao_gemm(config, "cast_config_grad_output", "cast_config_weight_for_grad_input",
                           "gemm_config_grad_input"),
             _torchao_gemm(config, "cast_config_grad_output_for_grad_weight", "cast_config_input_for_grad_weight",
                           "gemm_config_grad_weight"))
    return Recipe(f"torchao.float8 {_float8_label(gemms)}", "float8", *gemms)


def _float8_label(gemms: tuple[Gemm, ...]) -> str:
    """`tensorwise`, `rowwise`, `rowwise_with_gw_hp` (torchao's recipe names) when the products are one of them."""
    casts = [c for g in gemms for c in (g.a, g.b)]
    if all(c is not None and c.scaling == "tensor" and not c.pow2 for c in casts):
        return "tensorwise"
    if all(c is not None and c.scaling == "row" and c.pow2 for c in casts):
        return "rowwise"
    if gemms[2].a is None and all(c is not None for c in casts[:4]):
        return "rowwise_with_gw_hp"
    return "custom"


def _mx_recipe(kernel: Any, mode: Any, wgrad_hp: bool) -> Optional[Recipe]:
    if _enum_name(kernel) != "EMULATED":
        return None
    rule = {"RCEIL": "e8m0_rceil", "FLOOR": "e8m0_floor"}.get(_enum_name(mode))
    if rule is None:
        return None
    cast = Cast("float8_e4m3fn", "block", rule, block=32)
    gemm = Gemm(cast, cast, dequant="blocks")
    weight = Gemm(None, None) if wgrad_hp else gemm
    return Recipe(f"torchao.mxfp8 {rule.removeprefix('e8m0_')}" + (" wgrad_hp" if wgrad_hp else ""), "mxfp8",
                  gemm, gemm, weight)


def _torchao_mxfp8(module) -> Optional[Recipe]:
    cls = type(module)
    if cls.__name__ == "MXFP8Linear" and cls.__module__.startswith("torchao."):
        return _mx_recipe(module.kernel_preference, module.scale_calculation_mode, bool(module.wgrad_with_hp))
    weight = getattr(module, "weight", None)
    if weight is not None and type(weight).__name__ == "MXFP8TrainingWeightWrapperTensor" \
            and type(module).__name__ == "Linear":
        config = weight.config
        return _mx_recipe(config.kernel_preference, config.scale_calculation_mode, bool(config.wgrad_with_hp))
    return None


RECIPES: tuple[tuple[str, Callable[[Any], Optional[Recipe]]], ...] = (
    ("torchao.float8", _torchao_float8),
    ("torchao.mxfp8", _torchao_mxfp8),
)
"""(row name, reader): a reader returns the module's `Recipe`, or None when the module is not of its kind."""


def recipe_of(module) -> Optional[Recipe]:
    """The recipe `module` runs (the first row whose reader knows it), or None. A module of a known kind whose
    configuration the table cannot emulate raises ValueError with the reason."""
    for _, reader in RECIPES:
        found = reader(module)
        if found is not None:
            return found
    return None
