"""The public API: `oneiter.Recorder` in a hand-written loop writes what the CLI writes; replay, faults, errors."""

from __future__ import annotations

import gc
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from conftest import FAULT_ENV, MODEL_FILES, SMALL_ARGS, run_cli

import oneiter
from oneiter.errors import OneIterError
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.training import build_optimizer


def _contents(path) -> dict[str, np.ndarray]:
    """Every dataset of a recording by path, as raw bytes-comparable arrays."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return found


def _loop(model, inputs, loss_fn, out, **kwargs):
    """A user's own training loop around one iteration."""
    opt = build_optimizer("sgd", model.parameters())
    with oneiter.Recorder(model, out, optimizer=opt, **kwargs) as rec:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(rec.inputs(*inputs)))
        loss.backward()
        opt.step()
    return rec


def _resnet(seed: int = 0):
    bundle = load_model("resnet18", 2, seed, dict(SMALL_ARGS["resnet18"]))
    bundle.model.train()
    return bundle


def test_a_hand_written_loop_writes_what_the_cli_writes(tmp_path, resnet_ref):
    cli = resnet_ref  # recorded by the library call the CLI makes, as `record_small` does
    bundle = _resnet()
    rec = _loop(bundle.model, bundle.inputs, bundle.loss_fn, tmp_path / "api.h5")
    mine, theirs = _contents(tmp_path / "api.h5"), _contents(cli)
    assert sorted(mine) == sorted(theirs) and len(mine) > 300
    unequal = [name for name in mine if mine[name].tobytes() != theirs[name].tobytes()]
    assert unequal == []
    with h5py.File(cli) as f:
        assert rec.summary.num_calls == f.attrs["num_calls"] == 76 and rec.summary.loss == float(theirs["loss"])


def test_replay_through_the_api_loads_weights_and_batch_and_matches(tmp_path, resnet_ref):
    ref = resnet_ref
    other = _resnet()  # the labels (in loss_fn) are the reference's; weights and inputs are changed here
    with torch.no_grad():
        for param in other.model.parameters():
            param.add_(1.0)
    inputs = (torch.randn_like(other.inputs[0]),)
    _loop(other.model, inputs, other.loss_fn, tmp_path / "tgt.h5", replay=ref)
    result = oneiter.compare(ref, tmp_path / "tgt.h5")
    assert result.status == "match"
    assert all(row.metrics.max_abs == 0 for row in result.rows)
    with h5py.File(tmp_path / "tgt.h5") as f:
        assert f.attrs["local"] == "teacher_forced" and f.attrs["replay_of"] == str(ref)


def test_a_finished_block_keeps_only_its_summary(tmp_path, resnet_ref):
    """A loop that records again must not hold the previous recording's session, probe caches of reference
    tensors, modes or open reference file."""
    import weakref

    bundle = _resnet()
    opt = build_optimizer("sgd", bundle.model.parameters())
    with oneiter.Recorder(bundle.model, tmp_path / "tgt.h5", optimizer=opt, replay=resnet_ref) as rec:
        probe, ref = weakref.ref(rec.session.probe), rec.ref
        bundle.loss_fn(bundle.model(rec.inputs(*bundle.inputs))).backward()
        opt.step()
    assert rec.summary.num_calls == 76
    assert (rec.session, rec.ref, rec._modes, rec._swap) == (None, None, None, None)
    assert probe() is None  # nothing else held it
    assert not ref.file.id.valid  # the reference's HDF5 file is closed
    # nor the reruns' tensors: a forced child's autograd node once held them in a cycle the collector cannot see
    gc.collect()
    left = [o for o in gc.get_objects() if type(o).__name__ in ("_Forcing", "_ForcedCall")]
    assert [o for o in left if type(o).__name__ == "_Forcing"] == []
    assert all(o.forcing is None and o.values == [] for o in left)


def test_the_recorder_own_ops_never_reach_a_dispatch_mode(tmp_path):
    """The statistics and copies of what is captured run outside every dispatch mode: neither oneiter's random
    recorder nor a mode of the user's (a FLOP counter, a tracer) sees them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    bundle = _resnet()
    with Seen() as seen:
        _loop(bundle.model, bundle.inputs, bundle.loss_fn, tmp_path / "s.h5", level="stats")
    assert "convolution" in seen.ops  # the model's own ops are seen
    assert not {"aminmax", "linalg_vector_norm"} & seen.ops  # tensor_stats' are not


def test_a_model_file_fault_in_a_user_loop_is_named(tmp_path, monkeypatch):
    sys.path.insert(0, str(MODEL_FILES))
    try:
        import hf_llama

        torch.manual_seed(0)
        model, inputs, loss_fn = hf_llama.build(2)
        model.train()
        _loop(model, inputs, lambda out: loss_fn(out), tmp_path / "ref.h5", name="llama")
        monkeypatch.setenv(FAULT_ENV, "instance:model.layers.1.mlp.down_proj:0.001")
        torch.manual_seed(1)
        model, inputs, loss_fn = hf_llama.build(2)
        model.train()
        _loop(model, inputs, loss_fn, tmp_path / "tgt.h5", name="llama", replay=tmp_path / "ref.h5")
    finally:
        sys.path.remove(str(MODEL_FILES))
    verdict = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5").verdict()
    assert verdict["status"] == "diverged" and verdict["basis"] == "local_error"
    assert (verdict["module"], verdict["phase"]) == ("model.layers.1.mlp.down_proj", "forward")


def test_the_batch_is_the_first_forward_call_when_inputs_is_not_called(tmp_path):
    bundle = _resnet()
    opt = build_optimizer("sgd", bundle.model.parameters())
    with oneiter.Recorder(bundle.model, tmp_path / "a.h5", optimizer=opt):
        bundle.loss_fn(bundle.model(bundle.inputs[0])).backward()
        opt.step()
    with h5py.File(tmp_path / "a.h5") as f:
        assert list(f["batch"]) == ["input.0"]
        assert np.array_equal(f["batch/input.0"][()], bundle.inputs[0].numpy())
        assert f["batch/input.0"].attrs["arg"] == "input.0"


def test_an_exception_in_the_block_leaves_no_file_and_no_hooks(tmp_path):
    bundle = _resnet()
    backward = torch.Tensor.backward
    with pytest.raises(ZeroDivisionError):
        with oneiter.Recorder(bundle.model, tmp_path / "x.h5"):
            bundle.model(bundle.inputs[0])
            raise ZeroDivisionError("the user's code fails inside the block")
    assert not list(tmp_path.iterdir())
    assert torch.Tensor.backward is backward
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in bundle.model.modules())


def test_library_errors_name_parameters_and_the_cli_names_flags(tmp_path, resnet_ref):
    bundle = _resnet()
    with pytest.raises(OneIterError, match=r"^amp must be one of bf16, fp16 \(or None\), got 'fp8'$"):
        oneiter.Recorder(bundle.model, tmp_path / "x.h5", amp="fp8")
    with pytest.raises(OneIterError, match="out '.*ref.h5' already exists; pass force=True to overwrite it"):
        with oneiter.Recorder(bundle.model, resnet_ref):
            pass
    with pytest.raises(OneIterError, match="is the reference being replayed"):
        with oneiter.Recorder(bundle.model, resnet_ref, replay=resnet_ref, force=True):
            pass
    with pytest.raises(OneIterError, match=r"ended before any backward ran.*: run the loss.s backward"):
        with oneiter.Recorder(bundle.model, tmp_path / "y.h5") as rec:
            rec.inputs(bundle.inputs[0])
    assert not (tmp_path / "y.h5").exists()
    res = run_cli("record", "--model", "resnet18", "--amp", "fp8", "-o", tmp_path / "z.h5")
    assert res.exit_code == 2 and "--amp must be one of bf16, fp16" in res.stderr
    res = run_cli("record", "--model", "resnet18", "-o", resnet_ref)
    assert res.exit_code == 2 and "pass --force to overwrite it" in res.stderr


def test_import_oneiter_does_not_import_torch():
    code = "import sys, oneiter; oneiter.Recorder, oneiter.compare; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
