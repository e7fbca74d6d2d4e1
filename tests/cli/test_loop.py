"""The record -> replay -> compare loop end to end, on every built-in model, with its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import pytest
from conftest import BUILTIN, FAULT_LAYER, MODEL_FILES, record_small, replay, run_cli

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.engine import compare_files


@pytest.mark.slow
@pytest.mark.parametrize("model", BUILTIN)
def test_same_device_replay_matches_bit_for_bit(model, references, tmp_path):
    tgt = tmp_path / "tgt.h5"
    replay(references(model), tgt, seed=7)  # another RNG seed: random ops still take the reference's values
    result = compare_files(references(model), tgt)
    assert result.status == "match" and result.culprit is None
    measured = [r for r in result.rows if r.metrics is not None]
    assert len(measured) == len(result.rows) > 100
    assert all(r.metrics.max_abs == 0 for r in measured)
    assert result.local and not any(local.flagged for local in result.local)
    # a leaf's rerun is bitwise; a container's rerun may add its gradients in another order (forced children)
    containers = {local.module.rpartition(".")[0] for local in result.local} | {"(root)"}
    leaves = [local for local in result.local
              if local.module not in containers and local.phase in ("forward", "backward")]
    assert len(leaves) > 20 and all(local.metrics.max_abs == 0 for local in leaves)
    assert all(local.metrics.rel_l2 < 1e-6 for local in result.local)


@pytest.mark.slow
@pytest.mark.parametrize("model", BUILTIN)
def test_forward_fault_is_named_with_phase_forward(model, references, tmp_path):
    tgt, report = tmp_path / "tgt.h5", tmp_path / "r.json"
    replay(references(model), tgt, faults=[f"{FAULT_LAYER[model]}:forward=0.05"])
    res = run_cli("compare", references(model), tgt, "--json", report)
    assert res.exit_code == 1, res.output
    verdict = json.loads(report.read_text())["verdict"]
    assert verdict["status"] == "diverged"
    assert (verdict["module"], verdict["call"], verdict["phase"], verdict["tensor"]) == (
        FAULT_LAYER[model], 0, "forward", "output")
    assert f"culprit {FAULT_LAYER[model]}@0 forward output" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet18", "llama_tiny"])
def test_backward_only_fault_is_named_with_phase_backward(model, references, tmp_path):
    tgt = tmp_path / "tgt.h5"
    replay(references(model), tgt, faults=[f"{FAULT_LAYER[model]}:backward=0.05"])
    result = compare_files(references(model), tgt)
    verdict = result.verdict()
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == (FAULT_LAYER[model], "backward", "grad_input.0")
    # the forward pass is untouched: every forward entry matches exactly
    assert all(r.metrics.max_abs == 0 for r in result.rows if r.phase == "forward")


def test_backward_fault_without_local_data_falls_back_to_first_divergence(references, tmp_path):
    tgt = tmp_path / "tgt.h5"
    replay(references("resnet18"), tgt, faults=["layer2.0.conv1:backward=0.05"], isolate=False)
    result = compare_files(references("resnet18"), tgt)
    verdict = result.verdict()
    assert verdict["basis"] == "first_divergence" and verdict["culprit"] is None
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == ("layer2.0.conv1", "backward", "grad_input.0")


@pytest.mark.slow
def test_thread_count_change_is_a_match(tmp_path):
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, "resnet18", threads=2)
    replay(ref, tgt, threads=1)
    with IterationFile(ref) as a, IterationFile(tgt) as b:
        assert (a.meta["num_threads"], b.meta["num_threads"]) == (2, 1)
    result = compare_files(ref, tgt)
    assert result.status == "match", result.verdict()
    assert result.culprit is None and len(result.local) > 50


@pytest.mark.parametrize("spec", ["twice.py:build", "dict_output.py:build"])
def test_user_models_record_and_compare(spec, tmp_path):
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, str(MODEL_FILES / spec), batch_size=4)
    replay(ref, tgt)
    assert compare_files(ref, tgt).status == "match"
    bad = tmp_path / "bad.h5"
    layer = "shared.0" if spec.startswith("twice") else "cls"
    replay(ref, bad, faults=[layer])
    assert compare_files(ref, bad).verdict()["module"] == layer
    with IterationFile(ref) as f:
        keys = [k for k, _ in f.calls()]
        if spec.startswith("twice"):
            assert {"shared@0", "shared@1", "shared.0@0", "shared.0@1", "shared.1@1"} <= set(keys)
        else:
            names = set(f.file["calls/(root)@0/forward"]) | set(f.file["calls/(root)@0/backward"])
            assert {"input.0", "input.1", "output.logits", "output.value", "grad_output.logits"} <= names
            assert f.meta["optimizer"] == "adam"  # the optimizer that ran: the 4th item built Adam, not the sgd default


def test_cli_record_then_compare(tmp_path):
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    args = ["--model", "llama_tiny", "--batch-size", "2", "--model-arg", "seq_len=16"]
    res = run_cli("record", *args, "-o", ref)
    assert res.exit_code == 0, res.output
    assert "recorded" in res.stderr and ref.is_file()
    res = run_cli("record", "--device", "cpu", "--replay", ref, "-o", tgt)
    assert res.exit_code == 0, res.output
    res = run_cli("compare", ref, tgt)
    assert res.exit_code == 0 and res.stdout.startswith("MATCH")
    res = run_cli("record", *args, "-o", ref)  # exists: refused, untouched
    assert res.exit_code == 2 and "already exists" in res.stderr
    res = run_cli("inspect", ref)
    assert res.exit_code == 0 and "layers.1.feed_forward.w2@0" in res.stdout


def one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_bad_inputs_give_one_line_and_exit_2(references, tmp_path):
    ref = references("resnet18")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(ref.read_bytes()[: ref.stat().st_size // 2])
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5\n")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1, 2, 3]
    for bad in (truncated, text, foreign, tmp_path / "missing.h5"):
        for args in (("compare", ref, bad), ("inspect", bad), ("record", "--replay", bad, "-o", tmp_path / "o.h5")):
            one_line_error(run_cli(*args))
    assert not (tmp_path / "o.h5").exists()


def test_file_of_another_model_is_refused(references, tmp_path):
    line = one_line_error(run_cli("compare", references("resnet18"), references("mobilenet_v2")))
    assert "resnet18" in line and "mobilenet_v2" in line
    line = one_line_error(run_cli("record", "--model", "mobilenet_v2", "--replay", references("resnet18"),
                                  "-o", tmp_path / "x.h5"))
    assert "does not match" in line


def test_unknown_model_device_and_option(tmp_path):
    out = tmp_path / "x.h5"
    assert "unknown model" in one_line_error(run_cli("record", "--model", "resnet1000", "-o", out))
    assert "torch_npu" in one_line_error(run_cli("record", "--model", "resnet18", "--device", "npu", "-o", out))
    assert "unknown device" in one_line_error(run_cli("record", "--model", "resnet18", "--device", "tpu9", "-o", out))
    assert run_cli("record", "--model", "resnet18", "--batch-size", "0", "-o", out).exit_code == 2
    assert "--inject-fault" in one_line_error(run_cli("record", "--model", "resnet18", "--inject-fault",
                                                      "conv1:sideways", "-o", out))
    assert not out.exists()


@pytest.mark.slow
def test_vendor_plugin_is_imported_lazily_by_name(tmp_path):
    """A stand-in torch_npu: imported only for --device npu; without a device the error is one line, exit 2."""
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    # like the real torch_npu: rename the PrivateUse1 backend and register a `torch.npu` module
    (plugin / "torch_npu.py").write_text(
        "import os, pathlib, types, torch\n"
        "torch.utils.rename_privateuse1_backend('npu')\n"
        "npu = types.ModuleType('torch.npu')\n"
        "npu.is_available = lambda: False\n"
        "npu.device_count = lambda: 0\n"
        "torch._register_device_module('npu', npu)\n"
        "pathlib.Path(os.environ['MARK']).write_text('imported')\n")
    mark = tmp_path / "mark"
    env = {"PYTHONPATH": str(plugin), "MARK": str(mark), "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "oneiter", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=120)
    res = run("models")
    assert res.returncode == 0 and not mark.exists()
    res = run("record", "--model", "resnet18", "--device", "npu:0", "-o", str(tmp_path / "n.h5"))
    assert mark.read_text() == "imported"
    assert res.returncode == 2 and "not available" in res.stderr and "Traceback" not in res.stderr


def test_help_does_not_import_torch():
    code = "import sys; from oneiter.cli.main import app; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_demo_names_the_broken_layer(tmp_path):
    from oneiter.demo import run_demo

    demo = run_demo(tmp_path, model="llama_tiny", batch_size=2)
    assert demo.found and demo.named_layer == "layers.1.feed_forward.w2"


def test_compare_writes_html_and_tensorboard_reports(references, tmp_path):
    tgt = tmp_path / "tgt.h5"
    replay(references("llama_tiny"), tgt, amp="bf16", faults=["layers.1.feed_forward.w2"])
    html, tb, csv_path = tmp_path / "report.html", tmp_path / "tb", tmp_path / "rows.csv"
    res = run_cli("compare", references("llama_tiny"), tgt, "--html", html, "--tensorboard", tb, "--csv", csv_path,
                  "--json", "-")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)  # `--json -`: stdout holds the JSON alone
    assert doc["verdict"]["culprit"]["module"] == "layers.1.feed_forward.w2"
    page = html.read_text()
    assert "layers.1.feed_forward.w2" in page and 'id="oneiter-data"' in page
    assert list(tb.glob("events.out.tfevents.*"))
    assert csv_path.read_text().count("\n") == len(doc["rows"]) + 1
    res = run_cli("compare", references("llama_tiny"), tgt, "--html", references("llama_tiny"))
    assert res.exit_code == 2 and "would overwrite" in res.stderr


def test_user_model_file_imports_its_neighbours_and_replays_from_anywhere(tmp_path, monkeypatch):
    src = tmp_path / "proj"
    src.mkdir()
    (src / "my_layers.py").write_text(
        "import torch.nn as nn\nBlock = lambda: nn.Sequential(nn.Linear(6, 6), nn.ReLU())\n")
    (src / "net.py").write_text(
        "import torch, torch.nn as nn\nfrom my_layers import Block\n"
        "def build(batch_size):\n"
        "    model = nn.Sequential(Block(), nn.Linear(6, 2))\n"
        "    x, y = torch.randn(batch_size, 6), torch.randint(0, 2, (batch_size,))\n"
        "    return model, (x,), lambda out: nn.functional.cross_entropy(out, y)\n")
    monkeypatch.chdir(src)
    record_small(tmp_path / "ref.h5", "net.py:build", batch_size=4)  # a relative path
    monkeypatch.chdir(tmp_path)
    replay(tmp_path / "ref.h5", tmp_path / "tgt.h5")  # no --model: the stored spec is absolute
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for name in ("my_layers.py", "net.py"):
        (copy / name).write_text((src / name).read_text())
    replay(tmp_path / "ref.h5", tmp_path / "moved.h5", model=str(copy / "net.py:build"))
    assert compare_files(tmp_path / "ref.h5", tmp_path / "tgt.h5").status == "match"
    assert compare_files(tmp_path / "ref.h5", tmp_path / "moved.h5").status == "match"  # same file name, other folder
