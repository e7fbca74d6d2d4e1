"""replay --ops: which kernel inside the culprit, whether the program itself differs, and a reproducer for the vendor.

A tiny Hugging Face Llama recorded clean on the CPU in float32 (the reference the blame tests share); its first
decoder layer is traced op by op on this process's stack. The wrong kernels are a stand-in vendor plugin's
(`model_files/faulty_kernels.py`): `torch.library` over aten::silu, or over aten::silu_backward only, CPU float32
only, the autograd formula torch's own, knowing nothing of oneiter: its kernel is the one oneiter's CPU reruns would
run too, so they must find it and run torch's own instead. The Python-level change is faultkit's `function:silu` (an
extra scale in a replaced `F.silu`): no kernel is wrong, the program is.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import h5py
import pytest
from conftest import FAULT_ENV, MODEL_FILES, replay, run_cli

from oneiter.format import op_case
from oneiter.judge.replayed.op_verdict import flagged, replay_ops
from oneiter.runtime.devices import DEVICE_TYPES

pytest.importorskip("transformers")

LLAMA = str(MODEL_FILES / "hf_llama.py:build")
LAYER = "model.layers.0"


@pytest.fixture(scope="module")
def llama(references):
    return references(LLAMA)


def only_flagged(result) -> list[tuple[str, str]]:
    return [(r.op, r.phase) for r in result.rows if flagged(r, result.factor)]


def test_a_wrong_forward_kernel_is_named_with_its_inputs_strides_and_line(llama, plugin):
    plugin.install("silu")
    result = replay_ops(llama, LAYER, model=LLAMA)
    culprit = result.culprit
    assert only_flagged(result) == [("aten::silu", "forward")] and result.exit_code == 1
    assert (culprit.shapes, culprit.dtypes, culprit.strides) == ([[2, 8, 64]], ["float32"], [[512, 64, 1]])
    assert culprit.line.startswith("transformers/activations.py:") and culprit.line.endswith("in forward")
    assert culprit.rel_l2 == pytest.approx(1e-3, rel=1e-3) and culprit.reference == "cpu float64"
    # the noise is float32's on torch's own kernel (the plugin's replaced by silu.out's): 1e-7, not the wrong 1e-3
    assert culprit.noise < 1e-6 and culprit.ratio > 1e3 and culprit.noise_from in ("cpu", "unit roundoff")
    assert culprit.note == "its CPU kernel is not torch's own: rerun through torch's CPU kernel of aten::silu.out"
    assert any(n.startswith("calibration: the CPU kernel of aten::silu is not torch's own (registered at ")
               and "faulty_kernels.py:" in n for n in result.notes)
    assert not result.program_flagged  # the layer's code computed exactly gives the reference's tensors
    assert result.headline().startswith("DIVERGED: aten::silu (forward, op #")


def test_a_kernel_wrong_only_in_backward_is_named_in_backward(llama, plugin):
    plugin.install("silu_backward")
    result = replay_ops(llama, LAYER, model=LLAMA)
    culprit = result.culprit
    assert only_flagged(result) == [("aten::silu_backward", "backward")] and result.exit_code == 1
    assert culprit.node == "SiluBackward0" and culprit.line.startswith("transformers/activations.py:")
    assert culprit.shapes == [[2, 8, 64], [2, 8, 64]]  # the output gradient and the forward's input
    silu = next(r for r in result.rows if r.op == "aten::silu")
    assert silu.phase == "forward" and silu.ratio < 4


def test_a_clean_layer_under_bf16_autocast_flags_no_op(llama):
    result = replay_ops(llama, LAYER, model=LLAMA, amp="bf16")
    assert result.culprit is None and not result.program_flagged and result.exit_code == 0
    mms = [r for r in result.judged if r.op == "aten::mm"]
    assert mms and all(r.dtypes == ["bfloat16", "bfloat16"] for r in mms)  # the matmuls ran in bf16
    assert max(r.ratio for r in result.judged) < result.factor
    assert max(r.noise for r in mms) >= 2.0**-8  # at least bf16's unit roundoff
    assert result.headline().startswith("MATCH: no op of model.layers.0@0")


def test_a_python_level_change_is_a_departure_of_the_op_sequence(llama, tmp_path, monkeypatch):
    reference_ops, target = tmp_path / "ref_ops.json", tmp_path / "tgt_ops.json"
    res = run_cli("replay", llama, "-l", LAYER, "-m", LLAMA, "--ops", "--json", reference_ops)  # the reference
    assert res.exit_code == 0, res.output
    monkeypatch.setenv(FAULT_ENV, "function:silu:0.01")  # F.silu replaced: silu, then an extra scale
    res = run_cli("replay", llama, "-l", LAYER, "-m", LLAMA, "--ops", "--reference-ops", reference_ops,
                  "--json", target)
    assert res.exit_code == 1, res.output
    assert "DIVERGED (program): no op of model.layers.0@0 is above its expected noise" in res.stdout
    doc = json.loads(target.read_text())
    assert doc["culprit"] is None and doc["num_flagged"] == 0 and doc["program"]["flagged"]
    assert [t["name"] for t in doc["program"]["tensors"] if t["flagged"]][0] == "output"
    first, second = doc["program"]["departures"]
    assert (first["phase"], first["kind"], first["reference"], first["target"]) == (
        "forward", "insert", [], ["aten::mul.Tensor"])
    assert "model_files/faultkit.py:" in first["line"] and first["line"].endswith("in _scaled")
    assert doc["ops"][first["index"]]["op"] == "aten::mul.Tensor"
    assert doc["ops"][first["index"] - 1]["op"] == "aten::silu"
    assert (second["phase"], second["target"]) == ("backward", ["aten::mul.Tensor"])  # its gradient, scaled too


def test_the_reproducer_exits_1_on_the_faulty_stack_and_0_on_the_clean_one(llama, plugin, tmp_path):
    case = tmp_path / "case"
    plugin.install("silu")
    res = run_cli("replay", llama, "-l", LAYER, "-m", LLAMA, "--ops", "--repro", case)
    plugin.uninstall()
    assert res.exit_code == 1 and f"wrote {case / 'repro.py'}" in res.stdout, res.output
    script = case / "repro.py"
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(script.read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in getattr(node, "names", [])}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(script.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "oneiter" not in imported and {"torch", "h5py", "numpy"} <= imported
    with h5py.File(case / "case.h5", "r") as f:  # DIOPI-style: inputs by argument name, expected outputs, tolerances
        assert (f.attrs["op"], f.attrs["phase"], list(f[op_case.INPUTS])) == ("aten::silu", "forward", ["self"])
        assert f[op_case.OUTPUTS]["0"].attrs["dtype"] == "float64" and 0 < f.attrs["rtol"] < 1e-5
        # repro.py cannot import oneiter's device table: the case names its plugins (device type -> module)
        assert json.loads(f.attrs["plugins"]) == {t.name: t.plugin for t in DEVICE_TYPES.values() if t.plugin}

    def repro(*extra: str, **env: str) -> subprocess.CompletedProcess:
        # oneiter made unimportable: the reproducer must run without it
        code = ("import runpy, sys; sys.modules['oneiter'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        environ = {**os.environ, "PYTHONPATH": str(MODEL_FILES), **env}
        return subprocess.run([sys.executable, "-c", code, str(script), *extra], capture_output=True, text=True,
                              env=environ, timeout=120)

    faulty = repro("--plugin", "faulty_kernels", FAULTY_KERNEL="silu")
    assert faulty.returncode == 1, faulty.stdout + faulty.stderr
    assert "WRONG: the op's error on cpu is" in faulty.stdout and "fail" in faulty.stdout
    clean = repro()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "OK: the op's error on cpu is" in clean.stdout and ": pass" in clean.stdout
    with h5py.File(case / "case.h5", "r+") as f:  # the plugin of the device it runs on comes from the case
        f.attrs["plugins"] = json.dumps({"cpu": "faulty_kernels"})
    named = repro(FAULTY_KERNEL="silu")
    assert named.returncode == 1 and "WRONG: the op's error on cpu is" in named.stdout, named.stdout + named.stderr


def test_compare_drill_traces_the_culprit_call_and_shows_its_ops(llama, plugin, tmp_path):
    plugin.install("silu")
    target = tmp_path / "target.h5"
    replay(llama, target)
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    res = run_cli("compare", llama, target, "--drill", "--model", LLAMA, "--json", report, "--html", page)
    assert res.exit_code == 1, res.output
    drill = json.loads(report.read_text())["drill"]
    assert (drill["layer"], drill["call"]) == ("model.layers.0.mlp.act_fn", 0)
    assert (drill["ops"]["culprit"]["op"], drill["ops"]["culprit"]["phase"]) == ("aten::silu", "forward")
    assert "drill: the ops of model.layers.0.mlp.act_fn@0" in res.stdout
    html = page.read_text()
    assert "Inside the culprit: the ops of model.layers.0.mlp.act_fn@0" in html and "aten::silu" in html
    plugin.uninstall()
    with h5py.File(target, "r+") as f:  # as if it had run on an NPU this machine does not have
        f.attrs["device"] = "npu:0"
    res = run_cli("compare", llama, target, "--drill", "--model", LLAMA)
    assert res.exit_code == 1, res.output
    assert "drill: not run here (the target's device is not on this machine" in res.stdout
    assert (f"oneiter replay {llama} --layer model.layers.0.mlp.act_fn --call 0 --ops --device npu:0 --dtype float32 "
            f"--amp none --model {LLAMA}") in res.stdout.replace("\n", " ").replace("  ", " ")


def test_bad_op_options_are_one_line_exit_2(llama, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "case.h5").write_bytes(b"mine")
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps({"format": "oneiter.ops", "version": 1, "key": "model.layers.0@0",
                                   "ops": [{"op": "__import__('os')", "phase": "forward", "computes": True}]}))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "oneiter.ops", "version": 1, "key": "model.layers.1@0", "ops": []}))
    cases = [
        (("--repro", tmp_path / "r"), "--reference-ops and --repro go with --ops"),
        (("--ops", "--repro", tmp_path / "taken"), "already exists"),
        (("--ops", "--repeat", "3"), "with --ops the layer runs once"),
        (("--ops", "--reference-ops", hostile), "op row 0 is not a row of `replay --ops`"),
        (("--ops", "--reference-ops", tmp_path / "taken" / "case.h5"), "cannot be read as JSON"),
        (("--ops", "--reference-ops", deep), "cannot be read as JSON"),
        (("--ops", "--reference-ops", other), "--reference-ops traced model.layers.1@0, not model.layers.0@0"),
        (("--ops", "--amp", "fp8"), "--amp must be one of bf16, fp16"),
    ]
    for extra, message in cases:
        res = run_cli("replay", llama, "-l", LAYER, "-m", LLAMA, *extra)
        assert res.exit_code == 2 and message in res.stderr, (extra, res.output)
        assert len(res.stderr.strip().splitlines()) == 1
    assert (tmp_path / "taken" / "case.h5").read_bytes() == b"mine"
