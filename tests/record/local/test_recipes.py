"""The recipe table and the emulation it drives, checked against torchao itself on the CPU; the casts a float64 rerun
keeps; how a recipe row is judged.

`record/local/emulate.py` computes what a correct kernel of a recipe gives, in float64 arithmetic of its own
(`formats.round_to` for every cast, exact products): torchao's own Linears, run here on the CPU (whose `_scaled_mm`
is torch's), must land inside the emulation's interval, within their accumulation noise, in every product of forward
and backward — and a result 1e-3 off must not.
"""

from __future__ import annotations

import math

import pytest
import torch

from oneiter.format.schema import LocalRow
from oneiter.judge.iteration.blame import _judge
from oneiter.judge.measure.tolerance import NoisePolicy
from oneiter.record.local.emulate import linear
from oneiter.record.local.formats import round_to
from oneiter.record.local.recipes import recipe_of
from oneiter.record.modes.casts import KeptCasts

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz, torch.bfloat16,
           torch.float16]


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_rounding_to_a_format_is_torchs_cast_of_a_float32_value(dtype):
    """Ties to even, subnormals, saturation (float8 without infinities: clamped first, as torchao does)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=gen) * s for s in (1e-7, 1e-4, 1e-2, 1, 300, 7e4)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 65520.0, 2.0 ** -17 * 1.5])])
    largest = torch.finfo(dtype).max
    cast = (x.clamp(-largest, largest) if str(dtype).endswith(("fn", "fnuz")) else x).to(dtype).double()
    assert torch.equal(round_to(x.double(), dtype), cast)


def _torchao_linear(recipe: str, dtype):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe.startswith("mx"):
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        mode = ScaleCalculationMode.RCEIL if recipe == "mx_rceil" else ScaleCalculationMode.FLOOR
        return MXFP8Linear(64, 96, kernel_preference=KernelPreference.EMULATED,
                           scale_calculation_mode=mode).to(dtype)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model[0].to(dtype)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mx_rceil", "mx_floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torchaos_own_linear_lands_inside_the_emulation_and_an_error_of_1e_3_does_not(recipe, dtype):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    module = _torchao_linear(recipe, dtype)
    found = recipe_of(module)
    assert found is not None and found.name.startswith("torchao.")
    x = (torch.randn(32, 64) * 3).to(dtype).requires_grad_()
    g = torch.randn(32, 96).to(dtype)
    y = module(x)
    y.backward(g)
    name = str(dtype).removeprefix("torch.")
    emulated = linear(found, x.detach().double(), module.weight.detach().double(), module.bias.detach().double(),
                      g.double(), dict.fromkeys(("output", "grad_input", "weight", "bias"), name), "cpu")
    got = {"output": y, "grad_input": x.grad, "weight": module.weight.grad, "bias": module.bias.grad}
    for role, value in got.items():
        e = emulated[role]
        assert e.deviation(value) <= max(e.noise(), 2.0 ** -24), (role, e.deviation(value), e.noise())
        if dtype == torch.bfloat16:
            assert e.deviation(value) == 0.0, role  # inside the rounding interval: exactly
    off = emulated["output"].deviation(y.detach().double() * (1 + 1e-3))
    assert off > 100 * emulated["output"].noise() and off > 1e-4


def test_the_table_reads_torchaos_recipes_and_knows_a_plain_linear_runs_none():
    pytest.importorskip("torchao")
    names = {r: recipe_of(_torchao_linear(r, torch.float32)).name for r in ("tensorwise", "rowwise", "mx_rceil")}
    assert names == {"tensorwise": "torchao.float8 tensorwise", "rowwise": "torchao.float8 rowwise",
                     "mx_rceil": "torchao.mxfp8 rceil"}
    rowwise = recipe_of(_torchao_linear("rowwise", torch.float32))
    assert rowwise.forward.a.scaling == "row" and rowwise.forward.a.pow2 and rowwise.forward.inter == "bfloat16"
    tensorwise = recipe_of(_torchao_linear("tensorwise", torch.float32))
    assert tensorwise.grad_input.a.element == "float8_e5m2"  # gradients in e5m2, forward in e4m3
    assert recipe_of(torch.nn.Linear(4, 4)) is None


def test_a_float64_rerun_keeps_narrowing_casts_and_computes_scaled_products_exactly():
    x = torch.randn(8, 16, dtype=torch.float64)
    with KeptCasts():
        kept = [x.half(), x.to(torch.bfloat16), x.to(torch.float8_e4m3fn)]
        a8, b8 = torch.randn(8, 16), torch.randn(16, 4)
        exact = torch._scaled_mm(a8.double(), b8.double(), torch.tensor(0.5), torch.tensor(2.0))
    assert all(k.dtype == torch.float64 and torch.equal(k, x) for k in kept)
    assert torch.allclose(exact, a8.double() @ b8.double(), rtol=1e-12)
    with KeptCasts(seed=1):  # a run of the calibration's check: the casts as written, a scaled product still exact
        written = x.to(torch.float8_e4m3fn)
        checked = torch._scaled_mm(a8.to(torch.float8_e4m3fn), b8.t().contiguous().to(torch.float8_e4m3fn).t(),
                                   torch.tensor(0.5), torch.tensor(2.0), out_dtype=torch.float32)
    assert written.dtype == torch.float8_e4m3fn and torch.equal(written, x.to(torch.float8_e4m3fn))
    exact8 = a8.to(torch.float8_e4m3fn).double() @ b8.to(torch.float8_e4m3fn).double()
    assert checked.dtype == torch.float32 and torch.equal(checked, exact8.to(torch.float32))
    assert x.to(torch.float16).dtype == torch.float16  # outside the mode: torch's cast


def _row(**kw) -> LocalRow:
    base = dict(module="fc", call=0, phase="forward", tensor="output", seq=1, dtype="float32", numel=64,
                rel_l2=3.7e-2, max_abs=0.1, cosine=0.999, nan_ref=0, inf_ref=0, nan=0, inf=0, mismatch=0,
                noise_target=3e-7, noise_reference=0.0, calibration="recipe", recipe="torchao.float8 tensorwise",
                recipe_rel_l2=1e-7, format_cost=3.7e-2)
    return LocalRow(**{**base, **kw})


def test_a_recipe_row_is_judged_by_its_deviation_never_by_the_formats_cost():
    clean = _judge(_row(), NoisePolicy(), "float32")
    assert not clean.flagged and clean.error == 1e-7 and clean.rel_l2 == 3.7e-2 and clean.ratio < 1
    wrong = _judge(_row(recipe_rel_l2=1e-3), NoisePolicy(), "float32")
    assert wrong.flagged and wrong.ratio == pytest.approx(1e-3 / 3e-7)
    # a bfloat16 output: never below float32's roundoff (the accumulator's), not bfloat16's, which hides 1e-3
    bf16 = _judge(_row(dtype="bfloat16", noise_target=0.0, recipe_rel_l2=1e-3), NoisePolicy(), "bfloat16")
    assert bf16.flagged and bf16.expected == 2.0 ** -24
    plain = _judge(_row(recipe="", recipe_rel_l2=math.nan), NoisePolicy(), "float32")
    assert plain.flagged  # without a recipe, 3.7e-2 is the call's own error
