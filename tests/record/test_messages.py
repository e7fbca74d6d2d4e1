"""What a new user meets first: each refusal is one line saying what happened and what to do, and the things that
used to need a message (a closure step, a same-tensor batch, an API-written reference) just work."""

from __future__ import annotations

import h5py
import pytest
import torch
from conftest import MODEL_FILES, compare_verdict, run_cli

import oneiter
from oneiter.errors import OneIterError

DROPOUT = f"{MODEL_FILES / 'dropout.py'}:build"


def _mlp(extra: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)]
    return torch.nn.Sequential(*(layers + [torch.nn.Identity()] if extra else layers))


def _record(model, out, *, replay=None, optimizer="adamw", steps=2, **kwargs):
    """`steps` plain steps, then one recorded; AdamW has state by then."""
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with oneiter.Recorder(model, out, replay=replay, optimizer=opt if optimizer else None, **kwargs) as rec:
        torch.nn.functional.cross_entropy(model(rec.inputs(x)), y).backward()
        opt.step()
    return rec


def test_autocast_without_amp_is_refused_naming_the_amp_to_give(tmp_path):
    model = _mlp()
    with pytest.raises(OneIterError, match=r"^autocast \(bfloat16\) is on around the model's forward, but this "
                                           r"recording was given amp=None: give amp='bf16' \(with "
                                           r"manage_autocast=False"):
        with oneiter.Recorder(model, tmp_path / "x.h5"), torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8)).sum().backward()
    assert not (tmp_path / "x.h5").exists()
    with oneiter.Recorder(model, tmp_path / "ok.h5", amp="bf16", manage_autocast=False):  # told: recorded
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 8)).float().sum()
        loss.backward()
    with h5py.File(tmp_path / "ok.h5") as f:
        assert f.attrs["amp"] == "bf16"


def test_a_replay_without_the_optimizer_of_a_stateful_reference_is_refused(tmp_path):
    _record(_mlp(), tmp_path / "ref.h5")
    with pytest.raises(OneIterError, match=r"replay 'ref.h5' holds the state its adamw had at this step, and this "
                                           r"replay was given no optimizer to load it into: pass optimizer="):
        _record(_mlp(), tmp_path / "tgt.h5", replay=tmp_path / "ref.h5", optimizer=None)
    _record(_mlp(), tmp_path / "tgt.h5", replay=tmp_path / "ref.h5")  # with it: AdamW's moments loaded, a match
    code, verdict = compare_verdict(tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["num_not_judged"]) == (0, "match", 0)


def test_a_model_with_another_structure_is_refused_naming_the_first_difference(tmp_path):
    _record(_mlp(extra=True), tmp_path / "ref.h5")  # an Identity at the end: same state_dict, one more module
    with pytest.raises(OneIterError, match=r"model structure does not match the reference 'ref.h5' .*: it called "
                                           r"module '3' \(Identity\), which this model does not have"):
        _record(_mlp(), tmp_path / "tgt.h5", replay=tmp_path / "ref.h5")


def test_a_closure_step_records_its_forward_and_backward(tmp_path):
    """`optimizer.step(closure)` runs forward and backward inside the step (Lightning's automatic optimization,
    LBFGS): the Recorder reads gradients after the closure's backward and judges the update before it applies."""
    def run(out, replay=None):
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        with oneiter.Recorder(model, out, optimizer=opt, replay=replay):
            opt.step(closure)

    run(tmp_path / "ref.h5")
    run(tmp_path / "tgt.h5", replay=tmp_path / "ref.h5")
    with h5py.File(tmp_path / "ref.h5") as f:
        assert len(f["param_grads"]) == 4 and len(f["batch"]) == 1 and f.attrs["optimizer_state"] == "recorded"
    code, verdict = compare_verdict(tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["num_not_judged"], verdict["unprobed"]) == (0, "match", 0, [])


def test_the_same_tensor_passed_twice_is_two_batch_entries(tmp_path):
    model = _mlp()
    with oneiter.Recorder(model, tmp_path / "ref.h5"):
        x = torch.randn(2, 8)
        model(x).sum().backward()
    args = oneiter.inspect(tmp_path / "ref.h5")
    assert args.meta["batch_size"] == 2  # nothing said the batch size: its rows

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, a, b):
            return self.lin(a) - b

    for out, replay in (("twice.h5", None), ("twice_tgt.h5", "twice.h5")):
        torch.manual_seed(0)
        net = Twice()
        with oneiter.Recorder(net, tmp_path / out, replay=None if replay is None else tmp_path / replay):
            ids = torch.randn(2, 8)
            net(ids, b=ids).sum().backward()
    with h5py.File(tmp_path / "twice.h5") as f:
        assert sorted(f["batch"][n].attrs["arg"] for n in f["batch"]) == ["input.0", "kwarg.b"]


def test_record_quiet_prints_one_line_and_an_api_reference_replays_with_a_model_file(tmp_path):
    """An API-written reference that does not state its batch size (files before this change hold 0) replays with
    a model file: the batch size is the reference batch's rows (was `--batch-size must be at least 1, got 0`)."""
    res = run_cli("record", "-m", DROPOUT, "-o", tmp_path / "ref.h5", "-q")  # one line: what was written
    assert res.exit_code == 0 and [line[:9] for line in res.stderr.splitlines()] == ["recorded "]
    with h5py.File(tmp_path / "ref.h5", "r+") as f:
        f.attrs["batch_size"] = 0
    res = run_cli("record", "--replay", tmp_path / "ref.h5", "-m", DROPOUT, "-o", tmp_path / "tgt.h5", "-q")
    assert res.exit_code == 0 and len(res.stderr.splitlines()) == 1, res.stderr
    assert compare_verdict(tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path)[0] == 0
