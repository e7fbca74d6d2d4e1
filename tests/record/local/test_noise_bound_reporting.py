"""A noise bound that could not be measured is said in the report, never silent; and a value its precision cannot
resolve (a bias's gradient before a BatchNorm: 0 in exact arithmetic) is reported as rounding.

The bound (`record/local/probe.py` `_bound`: float64 reruns with the run's rounding injected) checks a calibrated
noise above the gate. Swin's attention `k_proj` bias gradients (0 in exact arithmetic: softmax ignores a constant
added to every key) had a NaN bound with nothing said: the injection took a dtype argument for a tensor
(`TypeError: 'bool' object is not callable`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import MODEL_FILES, record_small, replay

from oneiter.judge.iteration.engine import compare_files, unbounded_notes
from oneiter.record.local.probe import LocalProbe
from oneiter.record.modes.roundoff_mode import RoundoffInjection

ZOO = str(MODEL_FILES / "zoo_models.py:build")
CONV_BN = {"name": "nn_conv2d"}  # Conv2d with a bias, then BatchNorm2d: the bias's gradient is rounding


def test_the_rounding_injection_takes_a_dtype_argument_for_no_tensor():
    """An op whose tensors are integers and whose dtype argument is floating (a mask summed as floats)."""
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    with RoundoffInjection(7, 2.0 ** -8, 2.0 ** -24):
        summed = torch.sum(mask, dim=0, dtype=torch.float64)
    assert summed.tolist() == [2.0, 1.0, 1.0]


def test_the_notes_name_what_was_not_bounded_and_why():
    attrs = {"unbounded": '[{"what": "attn.k_proj.bias", "reason": "TypeError: boom"}]'}
    (note,) = unbounded_notes(attrs)
    assert "could not be measured for 1 calls or parameters" in note and "attn.k_proj.bias: TypeError: boom" in note
    assert unbounded_notes({}) == [] and unbounded_notes({"unbounded": "[]"}) == []


@pytest.fixture(scope="module")
def conv_bn(tmp_path_factory):
    ref = tmp_path_factory.mktemp("conv_bn") / "ref.h5"
    record_small(ref, ZOO, threads=1, model_args=CONV_BN)
    return ref


def test_a_bias_gradient_that_is_rounding_is_reported_as_rounding(conv_bn, tmp_path):
    """nn_conv2d under bf16: the second convolution's bias gradient is 4.3e+03 off the reference, its precision's own
    error for it 6.3e+03: `rounding`, said so, and counted apart from the rest."""
    target = tmp_path / "bf16.h5"
    replay(conv_bn, target, amp="bf16", threads=1)
    result = compare_files(conv_bn, target)
    row = next(r for r in result.rows if (r.module, r.phase, r.tensor) == ("3", "param_grad", "bias"))
    assert row.status == "rounding" and row.reason.startswith("its value is rounding: its precision's own error")
    assert result.local_for(row).rounding and row.metrics.rel_l2 > 1.0
    verdict = result.verdict_obj
    assert verdict.status == "match" and verdict.num_rounding_values >= 2
    assert f"{verdict.num_rounding_values} are rounding themselves" in verdict.headline


def test_a_bound_that_could_not_be_measured_is_a_warning(conv_bn, tmp_path, monkeypatch):
    def fails(self, rec, high):
        raise RuntimeError("no float64 kernel here")

    monkeypatch.setattr(LocalProbe, "_bound", fails)
    target = tmp_path / "bf16.h5"
    replay(conv_bn, target, amp="bf16", threads=1)
    verdict = compare_files(conv_bn, target).verdict_obj
    (warning,) = [w for w in verdict.warnings if "noise bound" in w]
    assert "RuntimeError: no float64 kernel here" in warning and "used unchecked" in warning
    assert any(line.startswith("warning: calibration: the noise bound") for line in verdict.lines)
