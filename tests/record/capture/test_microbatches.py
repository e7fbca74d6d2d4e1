"""An iteration of several microbatches (gradient accumulation) in a loop of one's own: K forwards and backwards in
one `oneiter.Recorder` block, then one optimizer step (docs/format.md "Microbatches"), on the tiny Hugging Face
Llama; and on a two-layer model, what the file holds and the orders a schedule may run microbatches in."""

from __future__ import annotations

import sys

import h5py
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from conftest import FAULT_ENV, MODEL_FILES, compare_verdict  # noqa: E402

import oneiter  # noqa: E402
from oneiter.errors import OneIterError  # noqa: E402
from oneiter.format.layout import IterationFile  # noqa: E402

# rows of each microbatch: microbatch 1 is the one with a single row, which the `@rows=1` fault alone hits
SIZES = {2: [2, 1], 4: [2, 1, 2, 2]}
BLOCK = "model.layers.1"


def _llama(seed: int, rows: int, monkeypatch, fault: str = ""):
    sys.path.insert(0, str(MODEL_FILES))
    try:
        import hf_llama

        if fault:
            monkeypatch.setenv(FAULT_ENV, fault)
        torch.manual_seed(seed)
        model, (ids,), _loss = hf_llama.build(rows, seq_len=6, hidden=16)
    finally:
        sys.path.remove(str(MODEL_FILES))
        monkeypatch.delenv(FAULT_ENV, raising=False)
    return model, ids


def _accumulate(out, seed: int, sizes: list[int], monkeypatch, fault: str = "", **recorder):
    """K microbatches (rows `sizes`), each `(loss / K).backward()`, then clipping and one AdamW step, in one block."""
    model, ids = _llama(seed, sum(sizes), monkeypatch, fault)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        with oneiter.Recorder(model, out, optimizer=opt, **recorder) as rec:
            for chunk in ids.split(sizes):
                x = rec.inputs(chunk)  # on replay: the reference's microbatch
                (model(input_ids=x, labels=x).loss / len(sizes)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    finally:
        sys.modules["faultkit"].undo_faults()
    return out


# K = 4 doubles every recording's calls: kept beside K = 2 for the suite's time budget among the slow tests
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["K2", "K4"])
def accumulated(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"microbatches{request.param}") / "ref.h5"
    with pytest.MonkeyPatch.context() as mp:
        _accumulate(out, 0, SIZES[request.param], mp)
    return out, request.param


def test_a_clean_replay_from_other_weights_is_a_match(accumulated, tmp_path, monkeypatch):
    ref, k = accumulated
    target = _accumulate(tmp_path / "tgt.h5", 3, SIZES[k], monkeypatch, replay=ref)
    code, verdict = compare_verdict(ref, target, tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    with IterationFile(ref) as a, IterationFile(target) as b:
        assert a.microbatches() == b.microbatches() == k
        assert b.microbatch_losses() == a.microbatch_losses()  # each microbatch's batch swapped in: bit for bit
        assert {m for m in b.call_microbatches().values()} == set(range(k))
    result = oneiter.compare(ref, target)
    assert all(r.metrics.max_abs == 0 for r in result.rows if r.phase in ("forward", "backward", "param_grad"))


def test_a_fault_in_one_block_in_every_microbatch_is_named(accumulated, tmp_path, monkeypatch):
    ref, k = accumulated
    target = _accumulate(tmp_path / "tgt.h5", 3, SIZES[k], monkeypatch, fault=f"instance:{BLOCK}", replay=ref)
    code, verdict = compare_verdict(ref, target, tmp_path)
    assert (code, verdict["basis"], verdict["focus"]) == (1, "local_error", "culprit")
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == (BLOCK, "forward", "output")
    assert (verdict["culprit"]["call"], verdict["culprit"]["microbatch"]) == (0, 0)  # the first, in causal order
    flagged = {(r.module, r.call) for r in oneiter.compare(ref, target).local if r.flagged and r.phase == "forward"}
    assert flagged == {(BLOCK, m) for m in range(k)}  # every microbatch's call of the block


def test_a_fault_in_microbatch_1_only_is_named_with_microbatch_1(accumulated, tmp_path, monkeypatch):
    """A kernel wrong for one batch shape (the microbatch of one row): only microbatch 1's call of the block is
    wrong, and the verdict names that call and its microbatch."""
    ref, k = accumulated
    target = _accumulate(tmp_path / "tgt.h5", 3, SIZES[k], monkeypatch, fault=f"instance:{BLOCK}@rows=1", replay=ref)
    code, verdict = compare_verdict(ref, target, tmp_path)
    assert (code, verdict["basis"], verdict["module"], verdict["phase"]) == (1, "local_error", BLOCK, "forward")
    assert (verdict["culprit"]["call"], verdict["culprit"]["microbatch"], verdict["microbatch"]) == (1, 1, 1)
    assert verdict["headline"].startswith(f"DIVERGED: culprit {BLOCK}@1 forward output (microbatch 1)")
    flagged = {(r.module, r.call) for r in oneiter.compare(ref, target).local if r.flagged and r.phase == "forward"}
    assert flagged == {(BLOCK, 1)}


def test_a_bf16_autocast_replay_is_a_match(accumulated, tmp_path, monkeypatch):
    ref, k = accumulated
    target = _accumulate(tmp_path / "tgt.h5", 3, SIZES[k], monkeypatch, replay=ref, amp="bf16")
    with h5py.File(target) as f:
        assert f.attrs["amp"] == "bf16" and f.attrs["microbatches"] == k
    code, verdict = compare_verdict(ref, target, tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    assert verdict["num_drift"] > 0  # bf16 differs everywhere: the match rests on each call's own error


# -- what the file holds, and in which orders microbatches may run (a two-layer model, no probes) ----------------------
def _mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + m)) for m in range(3)]
    return model, batches


def test_each_microbatch_is_recorded_with_its_number_batch_loss_and_the_accumulated_gradients(tmp_path):
    model, batches = _mlp()
    twin, _ = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with oneiter.Recorder(model, tmp_path / "a.h5", optimizer=opt) as rec:
        for x in batches:
            model(rec.inputs(x)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # changes the gradients in place, before the step
        opt.step()
    losses = [twin(x).pow(2).mean() for x in batches]
    for loss in losses:  # autograd accumulates them in this order: the same bits
        loss.backward()
    with h5py.File(tmp_path / "a.h5") as f:
        assert f.attrs["microbatches"] == 3
        assert sorted(f["calls"]) == [f"{m}@{c}" for m in ("(root)", "0", "1", "2") for c in range(3)]
        assert [f["calls"][f"0@{c}"].attrs.get("microbatch", 0) for c in range(3)] == [0, 1, 2]
        assert "microbatch" not in f["calls"]["0@0"].attrs  # absent: microbatch 0
        assert [(n, f["batch"][n].attrs.get("microbatch", 0)) for n in f["batch"]] == [
            ("input.0", 0), ("input.1", 1), ("input.2", 2)]
        for m, x in enumerate(batches):
            assert np.array_equal(f["batch"][f"input.{m}"][()], x.numpy())
        assert f["microbatch_loss"][()].tolist() == [float(loss.detach()) for loss in losses]
        assert float(f["loss"][()]) == float(torch.stack([loss.detach() for loss in losses]).sum())
        for name, param in twin.named_parameters():  # as the last backward left them, not clipped
            assert np.array_equal(f["param_grads"][name][()], param.grad.numpy())


def test_a_single_microbatch_is_written_as_before(tmp_path):
    model, batches = _mlp()
    with oneiter.Recorder(model, tmp_path / "one.h5") as rec:
        model(rec.inputs(batches[0])).sum().backward()
    with h5py.File(tmp_path / "one.h5") as f:
        assert "microbatches" not in f.attrs and "microbatch_loss" not in f
        assert not any("microbatch" in f["calls"][k].attrs for k in f["calls"])
        assert not any("microbatch" in f["batch"][n].attrs for n in f["batch"])


def _ordered(model, batches, order: str, rec):
    """Forwards and backwards of the microbatches in a schedule's order: alternating, all forwards first (GPipe) or
    one forward ahead (1F1B: forward of microbatch 1 before the backward of microbatch 0)."""
    losses = {}
    forward = lambda m: losses.__setitem__(m, model(rec.inputs(batches[m])).pow(2).mean())  # noqa: E731
    steps = {"alternating": "F0 B0 F1 B1 F2 B2", "gpipe": "F0 F1 F2 B0 B1 B2", "1f1b": "F0 F1 B0 F2 B1 B2"}[order]
    for op in steps.split():
        forward(int(op[1])) if op[0] == "F" else losses[int(op[1])].backward()
    return [float(losses[m].detach()) for m in range(len(batches))]


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
def test_forwards_run_ahead_of_backwards_number_and_attribute_each_microbatch_alike(tmp_path, order):
    """A schedule that runs forwards ahead of backwards records the same file, bit for bit, as one that alternates
    them: calls are numbered by their forward, each loss belongs to the microbatch whose forward made it."""
    files = {}
    for name in ("alternating", order):
        model, batches = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with oneiter.Recorder(model, tmp_path / f"{name}.h5", optimizer=opt) as rec:
            losses = _ordered(model, batches, name, rec)
            opt.step()
        files[name] = tmp_path / f"{name}.h5"
        with h5py.File(files[name]) as f:
            assert f["microbatch_loss"][()].tolist() == losses
    result = oneiter.compare(files["alternating"], files[order])
    assert result.exit_code == 0 and all(r.metrics.max_abs == 0 for r in result.rows)
    with IterationFile(files[order]) as f:
        assert f.call_microbatches() == {(m, c): c for m in ("(root)", "0", "1", "2") for c in range(3)}


def test_a_replay_runs_as_many_microbatches_as_its_reference(tmp_path):
    model, batches = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with oneiter.Recorder(model, tmp_path / "ref.h5", optimizer=opt) as rec:
        for x in batches[:2]:
            model(rec.inputs(x)).sum().backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(OneIterError, match="this replay ran 1 microbatch before its step, but the reference "
                                           "'ref.h5' ran 2: run as many microbatches"):
        with oneiter.Recorder(model, tmp_path / "fewer.h5", optimizer=opt, replay=tmp_path / "ref.h5") as rec:
            model(rec.inputs(batches[0])).sum().backward()
            opt.step()
    opt.zero_grad()
    with pytest.raises(OneIterError, match="this replay began microbatch 2 of its iteration, but the reference "
                                           "'ref.h5' ran 2 before its step"):
        with oneiter.Recorder(model, tmp_path / "more.h5", optimizer=opt, replay=tmp_path / "ref.h5") as rec:
            for x in batches:
                model(rec.inputs(x)).sum().backward()
    opt.zero_grad()
    with pytest.raises(OneIterError, match=r"rec.inputs\(\) after the optimizer's step"):
        with oneiter.Recorder(model, tmp_path / "after.h5", optimizer=opt) as rec:
            model(rec.inputs(batches[0])).sum().backward()
            opt.step()
            rec.inputs(batches[1])
    assert not any((tmp_path / n).exists() for n in ("fewer.h5", "more.h5", "after.h5"))


def test_a_block_around_the_last_microbatch_of_a_window_is_refused(tmp_path):
    """Opened after a microbatch of the window ran, the block would hold gradients of a batch it does not hold (a
    replay from the reference's weights then diverges): refused in one line, no file."""
    model, batches = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(batches[0]).sum().backward()  # the window's first microbatch, outside the block
    with pytest.raises(OneIterError, match=r"already hold gradients when this block's first backward runs \(0.weight\)"
                                           r": they were accumulated by microbatches run before the Recorder block"):
        with oneiter.Recorder(model, tmp_path / "late.h5", optimizer=opt) as rec:
            model(rec.inputs(batches[1])).sum().backward()
            opt.step()
    assert not (tmp_path / "late.h5").exists()
    opt.zero_grad(set_to_none=False)  # zeroed gradients are no accumulated ones
    with oneiter.Recorder(model, tmp_path / "zeroed.h5", optimizer=opt) as rec:
        model(rec.inputs(batches[1])).sum().backward()
        opt.step()


def test_a_step_recorder_screens_steps_of_two_microbatches_and_its_twin_runs_them(tmp_path, monkeypatch):
    """`StepRecorder.run` (what `record --steps` screens with): each step of a loop of one's own is two microbatches;
    a replay takes each step's two batches, its twin runs both again, and a kernel wrong for the rare tokens that
    first come at step 2 names step 2."""
    sys.path.insert(0, str(MODEL_FILES))
    try:
        import hf_llama
    finally:
        sys.path.remove(str(MODEL_FILES))

    def loop(out, seed, fault="", **kwargs):
        if fault:
            monkeypatch.setenv(FAULT_ENV, fault)
        torch.manual_seed(seed)
        model, _, _, _, batch = hf_llama.build_steps(2, seq_len=6, hidden=16, layers=1, rare_step=2)
        monkeypatch.delenv(FAULT_ENV, raising=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

        def one_step(step):
            (ids,), _ = batch(step)
            opt.zero_grad()
            for chunk in ids.split(1):  # two microbatches of one row
                x = rec.inputs(chunk)
                (model(input_ids=x, labels=x).loss / 2).backward()
            opt.step()

        try:
            with oneiter.StepRecorder(model, out, optimizer=opt, steps=3, **kwargs) as rec:
                rec.run(one_step)
        finally:
            sys.modules["faultkit"].undo_faults()
        return out

    ref = loop(tmp_path / "ref.h5", 0)
    result = oneiter.compare(ref, loop(tmp_path / "tgt.h5", 5, fault="ids:90:0.01", replay=ref))
    assert (result.exit_code, result.verdict()["step"]) == (1, 2)
    assert [r.bitwise for r in result.rows[:2]] == [True, True]  # before the rare tokens: each microbatch replayed
    with IterationFile(tmp_path / "tgt.h5") as f:  # the twin, unperturbed, gave the run's own first step
        assert [f.step(s).microbatches() for s in f.steps()] == [2, 2, 2] and f.meta["twin_check"] == 0.0
