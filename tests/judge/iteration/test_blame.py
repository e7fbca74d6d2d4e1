"""Blame under mixed precision: the layer whose own computation is wrong, not the first drifting one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import BUILTIN, FAULT_LAYER, MODEL_FILES, record_small, replay, run_cli

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.engine import compare_files, compare_local
from oneiter.judge.measure.tolerance import default_tolerance


@pytest.mark.slow
@pytest.mark.parametrize("model", BUILTIN)
def test_bf16_target_without_fault_is_a_match(model, references, replays):
    tgt = replays(model, amp="bf16")  # shared: the fallback test and tests/report's writers judge it too
    result = compare_files(references(model), tgt)
    verdict = result.verdict()
    assert verdict["status"] == "match" and verdict["culprit"] is None, verdict
    assert verdict["basis"] == "local_error" and verdict["num_local"] > 10
    # ... although the accumulated error leaves float32's tolerance right away
    assert result.first_divergence is not None
    assert result.rows[result.first_divergence].metrics.rel_l2 > default_tolerance("float32").rtol


@pytest.mark.slow
@pytest.mark.parametrize("model", BUILTIN)
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_bf16_target_with_a_5_percent_fault_names_that_layer(model, kind, references, replays):
    layer = FAULT_LAYER[model]
    tgt = replays(model, amp="bf16", faults=[f"{layer}:{kind}=0.05"])  # ResNet's forward one: shared
    result = compare_files(references(model), tgt)
    culprit = result.verdict()["culprit"]
    assert culprit is not None and culprit["module"] == layer and culprit["phase"] == kind, culprit
    assert culprit["tensor"] == ("output" if kind == "forward" else "grad_input.0")
    assert culprit["ratio"] > 4 and 0.045 < culprit["local_rel_l2"] < 0.06
    # accumulated error was already beyond float32 tolerance long before the culprit
    culprit_row = next(i for i, r in enumerate(result.rows)
                       if (r.module, r.call, r.phase, r.tensor) == (layer, 0, kind, culprit["tensor"]))
    assert result.first_divergence < culprit_row


def test_dropout_model_replays_random_masks(tmp_path):
    spec = str(MODEL_FILES / "dropout.py:build")
    ref, same, other = tmp_path / "ref.h5", tmp_path / "replayed.h5", tmp_path / "no_replay.h5"
    record_small(ref, spec, batch_size=8, seed=0)
    replay(ref, same, seed=123)
    replay(ref, other, seed=123, random_replay=False)
    with IterationFile(ref) as f:
        assert f.file["random"].attrs["num_ops"] == 2
    matched = compare_files(ref, same)
    assert matched.status == "match" and all(r.metrics.max_abs == 0 for r in matched.rows if r.metrics)
    diverged = compare_files(ref, other)
    assert diverged.status == "diverged"
    assert diverged.verdict()["module"] == "2"  # the first nn.Dropout


def test_nan_inf_origin_names_the_layer(references, tmp_path):
    tgt, report = tmp_path / "inf.h5", tmp_path / "r.json"
    replay(references("resnet18"), tgt, faults=["layer2.1.conv1:inf"], isolate=False)
    res = run_cli("compare", references("resnet18"), tgt, "--json", report)
    assert res.exit_code == 1
    assert res.stdout.splitlines()[1].startswith("NaN/Inf origin: layer2.1.conv1@0 forward output")
    origin = json.loads(report.read_text())["verdict"]["nan_origin"]
    assert origin == {"module": "layer2.1.conv1", "call": 0, "phase": "forward", "tensor": "output"}


def _conv_local_errors(result) -> list[float]:
    return [r.rel_l2 for r in result.local if r.phase == "forward" and r.module.endswith(("conv1", "conv2"))]


@pytest.mark.slow
def test_fallback_convolution_brings_conv_local_error_to_float32_rounding(references, replays, tmp_path):
    ref = references("resnet18")
    plain, fallback = replays("resnet18", amp="bf16"), tmp_path / "bf16_fb.h5"
    replay(ref, fallback, amp="bf16", fallback=["convolution"])
    before = _conv_local_errors(compare_files(ref, plain))
    after = _conv_local_errors(compare_files(ref, fallback))
    assert len(before) == len(after) == 17
    assert min(before) > 1e-3
    assert max(after) < 1e-6
    with IterationFile(fallback) as f:
        assert json.loads(f.meta["fallback_counts"])["conv2d"] >= 20


def test_against_cpu_names_the_faulty_layer_without_a_reference(tmp_path):
    out = tmp_path / "against.h5"
    record_small(out, "resnet18", amp="bf16", against="cpu", faults=["layer3.1.conv2:forward=0.05"])
    res = run_cli("compare", out)
    assert res.exit_code == 1, res.output
    assert "culprit layer3.1.conv2@0 forward output" in res.stdout
    clean = tmp_path / "clean.h5"
    record_small(clean, "resnet18", amp="bf16", against="cpu")
    assert compare_local(clean).status == "match"
    plain = tmp_path / "plain.h5"
    record_small(plain, "llama_tiny")
    res = run_cli("compare", plain)
    assert res.exit_code == 2 and "--against cpu" in res.stderr


@pytest.mark.slow
def test_tolerance_file_skip_and_factor(references, replays, tmp_path):
    ref, tgt = references("resnet18"), replays("resnet18", amp="bf16", faults=["layer3.1.conv2:forward=0.05"])
    skip = tmp_path / "skip.toml"
    skip.write_text('device = "cpu"\n[skip]\nmodules = ["layer3.1.conv2"]\n')
    res = run_cli("compare", ref, tgt, "--tolerances", skip)
    assert res.exit_code == 0 and "warning" not in res.stderr
    npu = tmp_path / "npu.toml"
    npu.write_text('device = "npu"\n')
    res = run_cli("compare", ref, tgt, "--tolerances", npu)
    assert "warning: npu.toml is for device 'npu', the target ran on 'cpu'" in res.stderr
    loose = tmp_path / "loose.py"  # an mmengine config with the same keys
    loose.write_text("module = [dict(pattern='layer3.*', factor=50.0)]\n")
    assert run_cli("compare", ref, tgt, "--tolerances", loose).exit_code == 0
    strict = tmp_path / "strict.toml"
    strict.write_text("[noise]\nfactor = 4.0\n")
    assert run_cli("compare", ref, tgt, "--tolerances", strict).exit_code == 1
    bad = tmp_path / "bad.toml"
    bad.write_text("[noize]\nfactor = 4\n")
    res = run_cli("compare", ref, tgt, "--tolerances", bad)
    assert res.exit_code == 2 and "noize" in res.stderr


def test_local_rows_sit_beside_accumulated_rows_in_the_json(references, tmp_path):
    tgt, report = tmp_path / "bf16.h5", tmp_path / "r.json"
    replay(references("llama_tiny"), tgt, amp="bf16")
    run_cli("compare", references("llama_tiny"), tgt, "--json", report)
    rows = json.loads(report.read_text())["rows"]
    local = [r for r in rows if r["local"]]
    assert local and all({"rel_l2", "expected", "ratio", "flagged"} <= set(r["local"]) for r in local)
    w2 = next(r for r in local if r["module"] == "layers.1.feed_forward.w2" and r["phase"] == "forward")
    assert w2["local"]["rel_l2"] < w2["rel_l2"]  # upstream drift is gone from the local error
    assert not np.isnan(w2["local"]["expected"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_target_in_another_dtype_is_judged_against_its_noise(dtype, references, tmp_path):
    ref, clean, broken = references("resnet18"), tmp_path / "clean.h5", tmp_path / "broken.h5"
    replay(ref, clean, dtype=dtype)
    assert compare_files(ref, clean).status == "match"
    replay(ref, broken, dtype=dtype, faults=["layer2.1.conv1:forward=0.05"])
    culprit = compare_files(ref, broken).verdict()["culprit"]
    assert (culprit["module"], culprit["phase"]) == ("layer2.1.conv1", "forward")
