"""Reduced-precision float32 modes (TF32): the flags a run records, the rounding that reproduces them, and a
target whose convolutions and matmuls run TF32 (CPU kernels standing for cuDNN/cuBLAS, `model_files/tf32kit.py`)
judged against a float32 CPU reference: flagged when its file says TF32 was off, a match when it says on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import MODEL_FILES, record_small, replay, run_cli

from oneiter.format.layout import IterationFile
from oneiter.format.schema import PRECISION_MODES, REDUCED_CALLS, REDUCED_TARGET
from oneiter.record.local.reduced import ReducedOperands
from oneiter.runtime import precision_modes as pm

SPEC = str(MODEL_FILES / "tf32_cnn.py:build")
ENV = "ONEITER_TEST_TF32"
CPU_FLAGS = ("torch.backends.mkldnn.matmul.fp32_precision", "torch.backends.mkldnn.conv.fp32_precision")


def _numpy_round(x: np.ndarray, bits: int) -> np.ndarray:
    """Reference rounding: round half to even on the mantissa, in uint64 (no overflow), NaN/Inf kept."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    low, half = u & ((1 << drop) - 1), 1 << (drop - 1)
    kept = u >> drop
    up = (low > half) | ((low == half) & (kept & 1 == 1))
    out = ((kept + up) << drop).astype(np.uint32)
    special = (u.astype(np.uint32) & 0x7F800000) == 0x7F800000
    return np.where(special, x.astype(np.float32).view(np.uint32), out).view(np.float32)


def _specials() -> np.ndarray:
    bits = [0x00000000, 0x80000000, 0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001, 0xBF801000, 0xBF803000,
            0x7F7FFFFF, 0xFF7FF000, 0x00001FFF, 0x00003000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001,
            0x3FFFF000, 0x3FFFEFFF]
    return np.array(bits, dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize("bits", [10, 7])
def test_rounding_is_bit_exact_against_numpy(bits):
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([random_bits, _specials(), rng.standard_normal(1000).astype(np.float32)])
    got = pm.round_mantissa(torch.from_numpy(x.copy()), bits).numpy().view(np.uint32)
    want = _numpy_round(x, bits).view(np.uint32)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]
    # ties to even, both ways; the largest float32 rounds to Inf; NaN stays NaN
    tf = pm.round_mantissa(torch.from_numpy(_specials()), 10).numpy().view(np.uint32)
    if bits == 10:
        assert [hex(v) for v in tf[2:6]] == ["0x3f800000", "0x3f804000", "0x3f800000", "0x3f802000"]
        assert tf[8] == 0x7F800000 and tf[14] == 0x7FC00001


def test_rounding_keeps_strides_and_leaves_other_dtypes():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    y = pm.round_mantissa(x, 10)
    assert y.stride() == x.stride() and not torch.equal(x, y)
    assert torch.equal(y, pm.round_mantissa(y, 10))  # idempotent
    d = torch.randn(4, dtype=torch.float64)
    assert pm.round_mantissa(d, 10) is d


def test_modes_follow_the_flags_of_the_runs_device_type():
    settings = {"torch.backends.fp32_precision": "none", "torch.backends.cuda.matmul.fp32_precision": "none",
                "torch.backends.cudnn.fp32_precision": "none", "torch.backends.cudnn.conv.fp32_precision": "tf32",
                "torch.backends.mkldnn.fp32_precision": "none", "torch.backends.mkldnn.matmul.fp32_precision": "bf16",
                "torch.backends.mkldnn.conv.fp32_precision": "none"}
    assert pm.modes_for("cuda", settings) == {"matmul": "ieee", "conv": "tf32"}
    assert pm.modes_for("cpu", settings) == {"matmul": "bf16", "conv": "ieee"}
    assert pm.modes_for("cuda", {**settings, "torch.backends.fp32_precision": "tf32"})["matmul"] == "tf32"
    # a torch without the fp32_precision API: the legacy switches
    legacy = {"torch.backends.cuda.matmul.allow_tf32": False, "torch.backends.cudnn.allow_tf32": True}
    assert pm.modes_for("cuda", legacy) == {"matmul": "ieee", "conv": "tf32"}
    assert pm.modes_for("npu", {"torch.npu.conv.allow_hf32": True}) == {"matmul": "ieee", "conv": "hf32"}
    assert pm.modes_for("mps", settings) == {"matmul": "ieee", "conv": "ieee"}
    described = pm.describe({"matmul": "tf32", "conv": "tf32", "flags": "cuda flags"})
    assert described == "matmul and conv in TF32 (cuda flags)"


def test_a_plain_cpu_run_reads_ieee_and_settings_are_recorded():
    modes = pm.current("cpu")
    assert (modes["matmul"], modes["conv"], modes["flags"]) == ("ieee", "ieee", "mkldnn flags")
    assert modes["settings"]["torch.backends.cudnn.conv.fp32_precision"] == "tf32"  # CUDA's default, not the CPU's
    assert pm.current("cuda")["conv"] == "tf32"
    assert pm.from_attr(pm.to_attr(modes)) == modes and pm.from_attr("") == {}


def test_the_dispatch_mode_rounds_operands_of_governed_ops_only():
    a, b, bias = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    with ReducedOperands({"matmul": "tf32"}) as mode:
        out = torch.nn.functional.linear(a, b.t(), bias)
        s = a.sum()
    want = torch.addmm(bias, pm.round_mantissa(a, 10), pm.round_mantissa(b, 10))
    assert torch.equal(out, want) and mode.rounded == 1 and torch.equal(s, a.sum())
    x, w = torch.randn(1, 2, 5, 5, requires_grad=True), torch.randn(3, 2, 3, 3, requires_grad=True)
    with ReducedOperands({"conv": "tf32"}) as mode:
        torch.nn.functional.conv2d(x, w).sum().backward()
    assert mode.rounded == 2  # convolution, convolution_backward


@pytest.fixture
def tf32_kernels():
    """After the test: torch's own CPU kernels back (the model file installs `tf32kit`'s when ONEITER_TEST_TF32
    is set)."""
    import sys

    yield
    kit = sys.modules.get("tf32kit")
    if kit is not None:
        kit.uninstall()


@pytest.fixture
def cpu_tf32_flags():
    """Set the flags a CPU run reads (oneDNN's) to tf32; restore them after."""
    saved = {name: pm._read(name) for name in CPU_FLAGS}

    def set_tf32():
        torch.backends.mkldnn.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.conv.fp32_precision = "tf32"

    yield set_tf32
    torch.backends.mkldnn.matmul.fp32_precision = saved[CPU_FLAGS[0]]
    torch.backends.mkldnn.conv.fp32_precision = saved[CPU_FLAGS[1]]


def _compare(ref, tgt, tmp_path):
    report = tmp_path / "report.json"
    res = run_cli("compare", ref, tgt, "--json", report)
    return res, json.loads(report.read_text())["verdict"]


def test_tf32_target_is_flagged_when_its_file_says_ieee_and_matches_when_it_says_tf32(tmp_path, tf32_kernels,
                                                                                      cpu_tf32_flags, monkeypatch):
    ref = tmp_path / "ref.h5"
    record_small(ref, SPEC)  # a clean float32 CPU reference
    monkeypatch.setenv(ENV, "1")

    off = tmp_path / "off.h5"
    replay(ref, off)  # TF32 kernels, flags saying float32: nothing to explain their rounding
    res, verdict = _compare(ref, off, tmp_path)
    culprit = verdict["culprit"]
    assert res.exit_code == 1 and verdict["status"] == "diverged", res.output
    where = (culprit["module"], culprit["call"], culprit["phase"], culprit["tensor"])
    assert where == ("conv1", 0, "forward", "output")
    assert culprit["ratio"] > 10

    cpu_tf32_flags()
    on = tmp_path / "on.h5"
    replay(ref, on)
    with IterationFile(on) as f:
        modes = pm.from_attr(f.meta[PRECISION_MODES])
        attrs = f.local_attrs()
    assert (modes["matmul"], modes["conv"], modes["flags"]) == ("tf32", "tf32", "mkldnn flags")
    assert json.loads(attrs[REDUCED_TARGET]) == {"conv": "tf32", "matmul": "tf32"}
    res, verdict = _compare(ref, on, tmp_path)
    assert res.exit_code == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", res.output
    assert verdict["num_flagged"] == 0 and verdict["unprobed"] == []
    calls = int(attrs[REDUCED_CALLS])
    assert calls >= 3  # conv1, conv2, fc at least (the root contains no governed op of its own)
    line = (f"precision: the target ran float32 matmul and conv in TF32 (mkldnn flags): the noise of {calls} calls "
            f"calibrated with TF32 operands")
    assert line in verdict["details"] and line in res.output
    assert verdict["precision"]["target"] == {"matmul": "tf32", "conv": "tf32", "flags": "mkldnn flags"}


@pytest.mark.parametrize("flags_on", [False, True], ids=["flags-off", "flags-on"])
def test_a_tf32_reference_is_calibrated_in_its_own_mode(flags_on, tmp_path, tf32_kernels, cpu_tf32_flags,
                                                        monkeypatch):
    """The other side: the reference ran TF32 (a CUDA reference), the target plain float32 on the CPU."""
    import sys

    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    monkeypatch.setenv(ENV, "1")
    if flags_on:
        cpu_tf32_flags()
    record_small(ref, SPEC)
    monkeypatch.delenv(ENV)
    sys.modules["tf32kit"].uninstall()
    torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = "none"
    replay(ref, tgt)
    res, verdict = _compare(ref, tgt, tmp_path)
    if not flags_on:  # nothing says the reference's convolutions were TF32: the clean target's conv1 stands out
        culprit = verdict["culprit"]
        assert res.exit_code == 1 and (culprit["module"], culprit["phase"]) == ("conv1", "forward"), res.output
        return
    assert res.exit_code == 0 and verdict["status"] == "match" and verdict["num_flagged"] == 0, res.output
    calls = verdict["precision"]["calibrated"]["reference_calls"]
    assert calls >= 3
    assert (f"precision: the reference ran float32 matmul and conv in TF32 (mkldnn flags): the noise of {calls} "
            f"calls calibrated with TF32 operands") in verdict["details"]


@pytest.mark.parametrize("flags_on", [False, True], ids=["flags-off", "flags-on"])
def test_device_calibration_is_held_to_the_trusted_cpus_with_the_recorded_modes(flags_on, tmp_path, tf32_kernels,
                                                                                 cpu_tf32_flags, monkeypatch):
    """`--calibrate device` on a device whose convolutions and matmuls round their operands to TF32 (the CPU with
    tf32kit's kernels stands for it): its own noise is TF32's. Where its flags say TF32, the trusted CPU's noise
    with TF32 operands explains it: a match. Where they say float32, the device's noise is far beyond the trusted
    CPU's float32 noise: a finding about the device, not a wider band."""
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, SPEC)
    monkeypatch.setenv(ENV, "1")
    if flags_on:
        cpu_tf32_flags()
    replay(ref, tgt, calibrate="device")
    res, verdict = _compare(ref, tgt, tmp_path)
    if flags_on:
        assert res.exit_code == 0 and verdict["status"] == "match" and verdict["untrusted"] == [], res.output
        return
    culprit = verdict["culprit"]
    assert res.exit_code == 1 and (culprit["module"], culprit["phase"]) == ("conv1", "forward"), res.output
    assert culprit["calibrated"] > 100 * culprit["expected"]  # the device's noise, not used as the band
    assert any(u["calibration"] == "device" and u["module"] == "conv1" for u in verdict["untrusted"])
    assert "a finding about the device's kernels" in res.output
