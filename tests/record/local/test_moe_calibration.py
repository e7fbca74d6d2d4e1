"""Calibration without float64: a Hugging Face MoE whose experts run `torch._grouped_mm` (no float64 kernel).

The float64 calibration rerun of an experts call fails; the probe estimates the noise by Monte Carlo in the run's
own precision instead (oneiter/record/local/montecarlo.py), so the experts stay probed and a fault in them is named
there, not at `model` as unattributed.
"""

from __future__ import annotations

import pytest
from conftest import MODEL_FILES, record_small, replay, replay_with_fault

from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.verdict import decide

pytest.importorskip("transformers")
MOE = str(MODEL_FILES / "hf_moe.py:build")
EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def moe_ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "ref.h5"
    # two threads, pinned: torch's default is whatever the machine gives this process (1 under OMP_NUM_THREADS=1 or
    # on one free core), and the replay with threads=1 must run another reduction order than the reference's
    record_small(out, MOE, batch_size=2, threads=2)
    return out


def _verdict(ref, tgt):
    result = compare_files(ref, tgt)
    return result, decide(result)


def test_grouped_mm_has_no_float64_kernel():
    import torch

    a, b = torch.randn(6, 16, dtype=torch.float64), torch.randn(2, 16, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, offs=torch.tensor([3, 6], dtype=torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"threads": 1}])
def test_clean_moe_replay_is_a_match_with_the_experts_probed(moe_ref, tmp_path, options):
    tgt = tmp_path / "tgt.h5"
    replay(moe_ref, tgt, **options)
    result, verdict = _verdict(moe_ref, tgt)
    assert verdict.exit_code == 0 and verdict.status == "match", verdict
    assert result.unprobed == []
    experts = [r for r in result.local if r.module.endswith("mlp.experts") and r.phase in ("forward", "backward")]
    assert {r.module for r in experts} == {EXPERTS, "model.layers.1.mlp.experts"}
    calibrated = {r.calibration for r in experts if r.calibrated is not None}
    if options:  # another thread count: the experts' sums differ in the last bits, so they are calibrated
        assert calibrated == {"cpu:monte_carlo"}, calibrated


@pytest.mark.slow
def test_a_fault_in_the_experts_is_named_with_a_monte_carlo_noise(moe_ref, tmp_path, monkeypatch):
    tgt = tmp_path / "tgt.h5"
    replay_with_fault(moe_ref, tgt, f"instance:{EXPERTS}", monkeypatch)
    result, verdict = _verdict(moe_ref, tgt)
    culprit = verdict.culprit
    assert verdict.exit_code == 1 and verdict.basis == "local_error", verdict
    assert (culprit.module, culprit.call, culprit.phase, culprit.tensor) == (EXPERTS, 0, "forward", "output")
    row = next(r for r in result.local if r.key == (EXPERTS, 0, "forward", "output"))
    assert row.calibration == "cpu:monte_carlo" and 0 < row.calibrated < 1e-5, row
    assert result.unprobed == []
