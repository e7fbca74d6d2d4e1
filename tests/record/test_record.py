"""record: the recording holds the iteration, and recording does not change a single bit of it."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import MODEL_FILES, SMALL_ARGS, record_small, run_cli

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.training import prepare, train_step


def plain_iteration(model: str, batch_size: int = 2, seed: int = 0, model_args=None):
    """The same iteration as `record` runs, without any hooks: loss, grads, updated params."""
    bundle = load_model(model, batch_size, seed, SMALL_ARGS[model] if model_args is None else model_args)
    setup = prepare(bundle, torch.device("cpu"))
    grads = {}

    def after_backward():
        grads.update({n: p.grad.clone() for n, p in bundle.model.named_parameters() if p.grad is not None})

    torch.manual_seed(seed)
    loss = train_step(setup, after_backward=after_backward)
    after = {n: t.detach().clone() for n, t in bundle.model.state_dict().items()}
    return loss, grads, after


@pytest.mark.slow
def test_recording_does_not_change_the_numbers_resnet18(tmp_path):
    """Full-size resnet18 (224x224): loss, every gradient and every updated parameter bitwise equal."""
    out = tmp_path / "r.h5"
    record_small(out, "resnet18", model_args={}, batch_size=2)
    loss, grads, after = plain_iteration("resnet18", model_args={})
    with IterationFile(out) as f:
        assert f.tensor("loss").item() == loss.item()
        assert f.meta["loss"] == loss.item()
        recorded_grads = f.state("param_grads")
        assert set(recorded_grads) == set(grads) and len(grads) == 62
        for name, path in recorded_grads.items():
            assert torch.equal(f.tensor(path), grads[name]), name
        recorded_after = f.state("state_after")
        assert set(recorded_after) == set(after)
        for name, path in recorded_after.items():
            assert torch.equal(f.tensor(path), after[name]), name


def test_every_module_call_is_recorded_in_execution_order(resnet_ref):
    with IterationFile(resnet_ref) as f:
        calls = f.calls()
        keys = [k for k, _ in calls]
        # torchvision's BasicBlock calls its one ReLU twice: both calls are kept
        assert "layer1.0.relu@0" in keys and "layer1.0.relu@1" in keys
        assert keys[:4] == ["(root)@0", "conv1@0", "bn1@0", "relu@0"]
        assert [a["exec_index"] for _, a in calls] == list(range(len(calls)))
        assert len(calls) == f.meta["num_calls"] == 76


def test_inplace_relu_input_is_captured_before_it_runs(resnet_ref):
    """relu(inplace) overwrites its input: the recorded input must be bn1's output, not relu's."""
    with IterationFile(resnet_ref) as f:
        relu_in = f.read("calls/relu@0/forward/input.0")
        relu_out = f.read("calls/relu@0/forward/output")
        bn_out = f.read("calls/bn1@0/forward/output")
        assert np.array_equal(relu_in, bn_out)
        assert (relu_in < 0).any() and not (relu_out < 0).any()
        assert np.array_equal(relu_out, np.maximum(bn_out, 0))


def test_gradients_around_a_call(resnet_ref):
    with IterationFile(resnet_ref) as f:
        # relu's grad_input is bn1's grad_output (the only consumer), and is zero where relu clipped
        g_in = f.read("calls/relu@0/backward/grad_input.0")
        assert np.array_equal(g_in, f.read("calls/bn1@0/backward/grad_output"))
        assert np.all(g_in[f.read("calls/relu@0/forward/input.0") < 0] == 0)
        # the root's grad_output is dloss/dlogits: cross entropy rows sum to zero
        assert np.allclose(f.read("calls/(root)@0/backward/grad_output").sum(axis=1), 0, atol=1e-6)
        # a block input feeds conv1 and the residual: the block's conv1 grad_input is its contribution only
        conv_gin = f.read("calls/layer1.0.conv1@0/backward/grad_input.0")
        block_gin = f.read("calls/layer1.0@0/backward/grad_input.0")
        assert not np.array_equal(conv_gin, block_gin)


def test_repeated_tensors_are_stored_once_as_hard_links(resnet_ref):
    with h5py.File(resnet_ref, "r") as f:
        out = f["calls/conv1@0/forward/output"]
        nxt = f["calls/bn1@0/forward/input.0"]
        assert out.id == nxt.id  # same object in the file
        assert f["batch/input.0"].id == f["calls/(root)@0/forward/input.0"].id


def test_metadata_and_complete_flag(resnet_ref):
    with IterationFile(resnet_ref) as f:
        m = f.meta
        assert m["schema"] == "oneiter.iteration" and m["schema_version"] == 4 and m["complete"] is True
        assert m["model"] == "resnet18" and m["device"] == "cpu" and m["dtype"] == "float32"
        assert m["seed"] == 0 and m["batch_size"] == 2 and m["torch_version"] == str(torch.__version__)
        assert f.dtype_of("calls/conv1@0/forward/output") == "float32"


def test_existing_output_is_not_overwritten(tmp_path):
    out = tmp_path / "keep.h5"
    out.write_bytes(b"precious")
    with pytest.raises(OneIterError, match="already exists"):
        record_small(out)
    assert out.read_bytes() == b"precious"
    record_small(out, force=True)
    assert IterationFile(out).meta["complete"]


def test_failed_run_leaves_no_file(tmp_path):
    out = tmp_path / "x.h5"
    with pytest.raises(OneIterError):
        record_small(out, faults=["no.such.layer"])
    assert list(tmp_path.iterdir()) == []


def test_include_exclude(tmp_path):
    out = tmp_path / "sel.h5"
    record_small(out, include=[r"^layer1\."], exclude=[r"relu"])
    with IterationFile(out) as f:
        modules = {a["module"] for _, a in f.calls()}
        assert modules and all(m.startswith("layer1.") and "relu" not in m for m in modules)
        assert "layer1.0.conv1" in modules
        assert len(f.state("param_grads")) == 62  # parameters are always recorded


def test_bfloat16_tensors_keep_their_bits(tmp_path):
    out = tmp_path / "bf16.h5"
    record_small(out, "llama_tiny", dtype="bfloat16")
    with IterationFile(out) as f:
        path = "calls/layers.0.attention.wq@0/forward/output"
        assert f.dtype_of(path) == "bfloat16"
        assert f.raw(path).dtype == np.uint16
        t = f.tensor(path)
        assert t.dtype == torch.bfloat16
        assert np.array_equal(t.float().numpy(), f.read(path))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mobilenet_v2", "llama_tiny"])
def test_recording_does_not_change_the_numbers_small_models(model, tmp_path):
    """llama_tiny's block input feeds three projections and a residual: the case an input alias used to break."""
    out = tmp_path / "r.h5"
    record_small(out, model)
    loss, grads, after = plain_iteration(model)
    with IterationFile(out) as f:
        assert f.tensor("loss").item() == loss.item()
        for name, path in f.state("param_grads").items():
            assert torch.equal(f.tensor(path), grads[name]), name
        for name, path in f.state("state_after").items():
            assert torch.equal(f.tensor(path), after[name]), name


def test_a_recording_never_chooses_the_code_that_runs(tmp_path):
    """A reference made from a model file is replayed only when the user names that file (built-ins default)."""
    spec = f"{MODEL_FILES / 'functional_cnn.py'}:build"
    record_small(tmp_path / "ref.h5", spec)
    for args in (["record", "--replay", tmp_path / "ref.h5", "-o", tmp_path / "t.h5"],
                 ["replay", tmp_path / "ref.h5", "--layer", "(root)"]):
        res = run_cli(*args)
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith(f"error: --model must be named: 'ref.h5' was recorded from the model file "
                                     f"'{spec}', and a recording never chooses which code runs")
    assert not (tmp_path / "t.h5").exists()
    assert run_cli("record", "--replay", tmp_path / "ref.h5", "--model", spec, "-o", tmp_path / "t.h5").exit_code == 0
    assert run_cli("replay", tmp_path / "ref.h5", "--layer", "(root)", "--model", spec).exit_code == 0


def test_user_mistakes_are_refused_with_one_line(tmp_path, resnet_ref):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 3)\n\n"
        "    def forward(self, x):\n"
        "        return self.lin(x) @ torch.ones(5, 2)\n\n\n"
        "def build(batch_size):\n"
        "    return Net(), (torch.randn(batch_size, 4),), lambda out: out.sum()\n\n\n"
        "def broken(batch_size):\n"
        "    raise ValueError('no such dataset')\n")
    cases = [
        (["--model", f"{bad}:build"], "error: the forward of (root)@0 raised RuntimeError: mat1 and mat2 shapes "
         f"cannot be multiplied (2x3 and 5x2) (at {bad}:10, in forward;"),
        (["--model", f"{bad}:broken"], f"error: the model builder raised ValueError: no such dataset (at {bad}:18, "
         "in broken;"),
        (["--model", "resnet18", "--include", "^nothing$"], "error: --include ['^nothing$'] / exclude [] leave no "
         "module of the model to record (module paths look like 'conv1')"),
        (["--replay", resnet_ref, "-b", "3"], "error: --batch-size 3 differs from the reference's 2: a replay runs "
         "the reference's batch; drop it"),
    ]
    for args, message in cases:
        res = run_cli("record", *args, "-b" if "-b" not in args else "--seed", "2" if "-b" not in args else "0",
                      "-o", tmp_path / "x.h5")
        assert res.exit_code == 2, res.output
        assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith(message), res.stderr
        assert not (tmp_path / "x.h5").exists()


def test_version():
    from oneiter import __version__

    res = run_cli("--version")
    assert res.exit_code == 0 and res.stdout == f"oneiter {__version__}\n"
