"""Several steps recorded through `oneiter.StepRecorder` in a hand-written loop (`steps=`, `rec.run(fn)`), and one step
recorded at step 6 of such a loop: the same findings as `oneiter record --steps` / `--step` (tests/judge/stepwise/
test_steps.py), on the tiny Hugging Face Llama whose step 6 first holds token ids >= 90."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

from conftest import FAULT_ENV, MODEL_FILES  # noqa: E402

import oneiter  # noqa: E402
from oneiter.errors import OneIterError  # noqa: E402
from oneiter.format.layout import IterationFile  # noqa: E402

RARE_FAULT = "ids:90:0.01"
STEPS = 8  # the rare ids come at step 6; two steps after it are enough here (the CLI's tests run 12)


def _llama(seed: int, monkeypatch, fault: str = ""):
    """The model, an AdamW and batch(step) (the model file's own fault applied when `fault`)."""
    sys.path.insert(0, str(MODEL_FILES))
    try:
        import hf_llama

        if fault:
            monkeypatch.setenv(FAULT_ENV, fault)
        torch.manual_seed(seed)
        model, _inputs, _loss, _opt, batch = hf_llama.build_steps(2, layers=1)
    finally:
        sys.path.remove(str(MODEL_FILES))
        monkeypatch.delenv(FAULT_ENV, raising=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), batch


def _body(model, opt, batch, rec):
    def one_step(step):
        (ids,), loss_fn = batch(step)
        ids = rec.inputs(ids) if rec is not None else ids  # on replay: the reference's batch of this step
        opt.zero_grad()
        loss_fn(model(ids)).backward()
        opt.step()
    return one_step


@pytest.fixture(scope="module")
def loop_ref(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        model, opt, batch = _llama(0, mp)
    out = tmp_path_factory.mktemp("loop") / "ref.h5"
    with oneiter.StepRecorder(model, out, optimizer=opt, steps=STEPS) as rec:
        rec.run(_body(model, opt, batch, rec))
    assert rec.summary.num_steps == STEPS
    return out


def _replay(ref, out, monkeypatch, **kwargs):
    model, opt, batch = _llama(5, monkeypatch, kwargs.pop("fault", ""))  # other weights: the replay loads them
    try:
        with oneiter.StepRecorder(model, out, optimizer=opt, replay=ref, steps=STEPS, **kwargs) as rec:
            rec.run(_body(model, opt, batch, rec))
    finally:
        sys.modules["faultkit"].undo_faults()
    return out


def test_a_hand_written_loop_names_step_6(loop_ref, tmp_path, monkeypatch):
    result = oneiter.compare(loop_ref, _replay(loop_ref, tmp_path / "tgt.h5", monkeypatch, fault=RARE_FAULT))
    verdict = result.verdict()
    assert (result.exit_code, verdict["step"], verdict["basis"]) == (1, 6, "band")
    assert [r.bitwise for r in result.rows[:6]] == [True] * 6 and result.rows[6].outside
    assert verdict["commands"] is None  # a Recorder file names no model spec: the details say what to do instead
    assert any("oneiter.Recorder around iteration 6" in line for line in verdict["details"])


def test_a_hand_written_loop_in_bf16_is_not_flagged(loop_ref, tmp_path, monkeypatch):
    result = oneiter.compare(loop_ref, _replay(loop_ref, tmp_path / "tgt.h5", monkeypatch, amp="bf16"))
    assert (result.exit_code, result.step) == (0, None)
    assert not any(r.bitwise for r in result.rows) and all(r.ratio < 0.5 for r in result.rows)


def test_a_target_whose_float32_matmuls_run_tf32_is_perturbed_as_tf32(loop_ref, tmp_path, monkeypatch):
    """TF32 (here the CPU's oneDNN flag, which this CPU may not act on: the recorded mode is the flag's) rounds a
    float32 matmul's inputs to 10 mantissa bits; the twin's perturbation is then TF32's unit roundoff, 2^-11, not
    float32's — a float32-sized one would vanish in that rounding, and on an H200 a clean TF32 step was flagged."""
    flag = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "tf32"
    try:
        target = _replay(loop_ref, tmp_path / "tgt.h5", monkeypatch)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = flag
    with IterationFile(target) as f:
        assert f.meta["twin_roundoff"] == 2.0 ** -11 and '"matmul": "tf32"' in f.meta["precision_modes"]
    with IterationFile(loop_ref) as f:
        assert '"matmul": "ieee"' in f.meta["precision_modes"]
    result = oneiter.compare(loop_ref, target)
    assert (result.exit_code, result.step) == (0, None)


def _at_step_6(model, opt, batch, out, **kwargs):
    """Steps 0-5 of the loop unrecorded, then step 6 in a Recorder."""
    body = _body(model, opt, batch, None)
    for step in range(6):
        body(step)
    with oneiter.Recorder(model, out, optimizer=opt, seed=None, meta={"iteration": 6}, **kwargs) as rec:
        _body(model, opt, batch, rec)(6)


def test_step_6_of_a_hand_written_loop_replays_exactly_and_names_the_embedding(tmp_path, monkeypatch):
    """The reference's Recorder around step 6 holds AdamW's moments; the target's loop opens its Recorder at its
    own step 6 (fresh weights, nothing run before): the replay loads weights and moments, every value is the
    reference's, the updates judged; with the rare-token kernel wrong, the embedding is named."""
    model, opt, batch = _llama(0, monkeypatch)
    _at_step_6(model, opt, batch, tmp_path / "ref6.h5")
    for name, fault in (("clean", ""), ("fault", RARE_FAULT)):
        model, opt, batch = _llama(5, monkeypatch, fault)
        try:
            with oneiter.Recorder(model, tmp_path / f"{name}.h5", optimizer=opt, replay=tmp_path / "ref6.h5") as rec:
                _body(model, opt, batch, rec)(6)
        finally:
            sys.modules["faultkit"].undo_faults()
        result = oneiter.compare(tmp_path / "ref6.h5", tmp_path / f"{name}.h5")
        verdict = result.verdict()
        if fault:
            assert (verdict["basis"], verdict["module"], verdict["phase"]) == ("local_error", "model.embed_tokens",
                                                                              "forward")
        else:
            assert (result.exit_code, verdict["num_not_judged"]) == (0, 0)
            assert all(r.metrics.max_abs == 0 for r in result.rows)
            assert {r.status for r in result.rows if r.phase == "optimizer"} == {"match"}


def test_steps_arguments_are_checked(loop_ref, tmp_path, monkeypatch):
    model, opt, batch = _llama(0, monkeypatch)
    for steps, said in ((0, "steps must be at least 1, got 0"), (True, "steps must be a number of steps"),
                        ([2, 1], "steps must be increasing step numbers")):
        with pytest.raises(OneIterError, match=said):
            oneiter.StepRecorder(model, tmp_path / "x.h5", optimizer=opt, steps=steps).__enter__()
    with pytest.raises(OneIterError, match="records 8 steps: replay them with steps=8"):
        with oneiter.Recorder(model, tmp_path / "x.h5", optimizer=opt, replay=loop_ref) as rec:
            _body(model, opt, batch, rec)(0)
    with pytest.raises(OneIterError, match="rec.inputs.. works inside a step"):
        with oneiter.StepRecorder(model, tmp_path / "x.h5", optimizer=opt, steps=2) as rec:
            rec.inputs(torch.zeros(2, 8, dtype=torch.long))
    assert not (tmp_path / "x.h5").exists()
    with IterationFile(loop_ref) as f:  # the Recorder's file: the same layout as `oneiter record --steps`
        assert f.steps() == list(range(STEPS)) and f.signature().values.shape == (STEPS, 25)
