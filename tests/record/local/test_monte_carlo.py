"""The Monte Carlo noise estimate (oneiter/record/local/montecarlo.py) against the float64-based one, on ops that have
float64 (tests/model_files/float64_ops.py: conv, linear, layer norm, softmax, silu): every row calibrated once
with the float64 rerun and once with it refused; the two noises agree within a factor of 4 (measured: 0.5x-2.7x,
bench/monte_carlo_noise.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import MODEL_FILES, record_small, replay

from oneiter.judge.iteration.engine import compare_files
from oneiter.record.local.montecarlo import MONTE_CARLO
from oneiter.record.local.probe import LocalProbe
from oneiter.record.local.rerun import Perturbation
from oneiter.record.local.rows import JudgedRow

OPS = str(MODEL_FILES / "float64_ops.py:build")
FACTOR = 4.0


def _refused(self, rec, site, where):
    return None, f"{where}:{MONTE_CARLO}"


def _noises(ref, out, refuse: bool, **options) -> dict:
    with mock.patch.object(JudgedRow, "needs_noise", lambda self, roundoff: True), \
            mock.patch.object(LocalProbe, "_high", _refused if refuse else LocalProbe._high):
        replay(ref, out, **options)
    return {r.key: (r.calibrated, r.calibration) for r in compare_files(ref, out).local
            if r.calibrated is not None and r.phase != "optimizer"}  # the optimizer's high step runs on the CPU


@pytest.mark.parametrize("options", [{}, {"amp": "bf16"}], ids=["float32", "bf16"])
def test_monte_carlo_noise_is_within_a_factor_of_the_float64_one(tmp_path, options):
    ref = tmp_path / "ref.h5"
    record_small(ref, OPS, batch_size=4, seed=0)
    f64 = _noises(ref, tmp_path / "f64.h5", False, **options)
    mc = _noises(ref, tmp_path / "mc.h5", True, **options)
    assert {how for _, how in f64.values()} == {"cpu"}
    assert {how for _, how in mc.values()} == {"cpu:monte_carlo"}
    modules = set()
    for key, (noise, _) in f64.items():
        if noise <= 1e-12:
            continue
        modules.add(key[0])
        assert noise / FACTOR < mc[key][0] < noise * FACTOR, (key, noise, mc[key][0])
    assert {"conv", "lin1", "norm", "softmax", "act", "lin2"} <= modules
    assert any(key[2] == "param_grad" for key in f64)  # summed contributions: the samples' sums


def test_a_perturbation_is_reproducible_and_about_one_unit_in_the_last_place():
    x = torch.randn(1000)
    a, b = Perturbation((7, 2.0**-24))(x), Perturbation((7, 2.0**-24))(x)
    assert torch.equal(a, b) and not torch.equal(a, Perturbation((8, 2.0**-24))(x))
    rel = ((a - x) / x).abs()
    assert rel.max() <= 2.0**-22 and (rel > 0).float().mean() > 0.9
    y = Perturbation((7, 2.0**-8))(x)  # float32 values of a bf16 run: perturbed at bf16's roundoff
    assert torch.allclose(((y - x) / x).abs(), torch.full_like(x, 2.0**-7), rtol=1e-3)
    assert Perturbation(None)(x) is x
