"""The PyTorch Lightning callback: step 2 of a real `lightning.Trainer` run of a tiny random Llama
(`tests/model_files/lightning_llama.py`), reference and replays, under automatic and manual optimization."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning callback needs lightning (pip install -e '.[lightning]')")
pytest.importorskip("transformers", reason="the Lightning module here wraps a Hugging Face Llama")

from conftest import FAULT_ENV, MODEL_FILES, assert_reads_back, compare_verdict  # noqa: E402

import oneiter  # noqa: E402
from oneiter.api import compare_ranks  # noqa: E402
from oneiter.errors import OneIterError  # noqa: E402
from oneiter.integrations.lightning import OneIterCallback  # noqa: E402
from oneiter.record.options import RecordOptions  # noqa: E402

sys.path.insert(0, str(MODEL_FILES))
import lightning_llama  # noqa: E402

FAULT = "instance:model.layers.1.mlp.down_proj:0.001"  # inside the HF model: the Lightning path is model.model...
CULPRIT = "model.model.layers.1.mlp.down_proj"
CLIPPED = ("(optimizer)", "the gradients changed between backward and the step")


def _fit(tmp_path, callback, **kwargs):
    lightning_llama.fit([callback], root=str(tmp_path), **kwargs)
    return callback


@pytest.fixture(scope="module", params=[False, True], ids=["automatic", "manual"])
def lit_ref(request, tmp_path_factory):
    """Step 2 (AdamW has moments from steps 0 and 1 by then) of a float32 run, recorded once per optimization
    style."""
    tmp = tmp_path_factory.mktemp("lightning")
    callback = _fit(tmp, OneIterCallback(step=2, out=tmp / "ref.h5"), manual=request.param)
    return tmp / "ref.h5", request.param, callback


def test_the_callback_records_step_2_with_the_training_step_batch(lit_ref):
    ref, manual, callback = lit_ref
    assert callback.summary.path == ref and callback.summary.num_calls > 20
    with h5py.File(ref) as f:
        assert [f["batch"][n].attrs["arg"] for n in f["batch"]] == ["input.0.0"]  # training_step((ids,), batch_idx)
        assert f.attrs["iteration"] == 2 and f.attrs["framework"] == "lightning"
        assert (f.attrs["precision"], f.attrs["optimizer"], f.attrs["optimizer_state"]) == ("32-true", "adamw",
                                                                                          "recorded")
        assert f.attrs["batch_size"] == 2  # the batch's rows: nothing else said
        # the loss Lightning's backward ran on, and the state AdamW held when step 2 began
        assert f.attrs["loss"] == pytest.approx(float(f["loss"][()]), abs=0)
        assert len(f["optimizer_state"]) == 3 * len(f["param_grads"])


def test_a_bf16_mixed_replay_is_a_match_with_every_update_judged(lit_ref, tmp_path, recwarn):
    """Other initial weights and data: the replay takes the reference's weights, batch and AdamW state at step 2,
    runs forward and backward inside Lightning's `optimizer.step(closure)` under bf16 autocast, and every call and
    every updated weight is judged."""
    ref, manual, _ = lit_ref
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=ref), model_seed=3, data_seed=7,
         manual=manual, precision="bf16-mixed")
    with h5py.File(tmp_path / "tgt.h5") as f:
        assert (f.attrs["amp"], f.attrs["optimizer_state"]) == ("bf16", "loaded")
    code, verdict = compare_verdict(ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    assert (verdict["num_not_judged"], verdict["unprobed"], verdict["warnings"]) == (0, [], [])
    rows = oneiter.compare(ref, tmp_path / "tgt.h5").to_json()["rows"]
    updates = [r for r in rows if r["phase"] == "optimizer"]
    assert len(updates) == len([r for r in rows if r["phase"] == "param_grad"]) > 20
    # each update judged by the shadow step of AdamW (started from the reference's moments): none `not_judged`
    assert all(r["status"] in ("match", "drift") and not r["local"]["flagged"] for r in updates)
    assert not [w for w in recwarn.list if "updates not judged" in str(w.message)]


def test_a_fault_in_one_linear_is_named(lit_ref, tmp_path, monkeypatch):
    ref, manual, _ = lit_ref
    monkeypatch.setenv(FAULT_ENV, FAULT)
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=ref), model_seed=3, data_seed=7,
         manual=manual)
    code, verdict = compare_verdict(ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"], verdict["focus"]) == (1, "diverged", "local_error", "culprit")
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == (CULPRIT, "forward", "output")


def test_the_callbacks_file_reads_back(lit_ref):
    """`inspect`, `compare` and `replay --layer` (with the module's builder) take it."""
    assert_reads_back(lit_ref[0], "model.model.layers.0", f"{MODEL_FILES / 'lightning_llama.py'}:build")


# -- a module compiled in configure_model, with dropout ---------------------------------------------------------------
@pytest.fixture(scope="module")
def dropout_ref(tmp_path_factory):
    """Step 2 of an eager run with attention dropout 0.1 (automatic optimization), recorded once."""
    tmp = tmp_path_factory.mktemp("lightning_dropout")
    _fit(tmp, OneIterCallback(step=2, out=tmp / "ref.h5"), dropout=0.1)
    return tmp / "ref.h5"


@pytest.mark.slow  # inductor compiles the decoder twice (~10 s each on 2 cores)
def test_a_module_compiled_in_configure_model_replays_an_eager_reference(dropout_ref, tmp_path, monkeypatch):
    """`configure_model` compiles the decoder (`torch.compile`): the callback finds the compiled block, has its
    dropout drawn through aten ops from its first compile on, and replays the eager reference's masks into it: a clean
    replay matches, and a fault inside the compiled code is named at the block."""
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "clean.h5", replay=dropout_ref), model_seed=3, data_seed=7,
         dropout=0.1, compile=True)
    with h5py.File(tmp_path / "clean.h5") as f:
        compiled = __import__("json").loads(f.attrs["compiled"])
    assert list(compiled["blocks"]) == ["model.model"] and compiled["random_ops"] == 2  # attention, per layer
    code, verdict = compare_verdict(dropout_ref, tmp_path / "clean.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    monkeypatch.setenv(FAULT_ENV, FAULT)
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "fault.h5", replay=dropout_ref), model_seed=3, data_seed=7,
         dropout=0.1, compile=True)
    code, verdict = compare_verdict(dropout_ref, tmp_path / "fault.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (1, "diverged", "local_error"), verdict["headline"]
    assert (verdict["module"], verdict["phase"]) == ("model.model", "forward")


# -- precision plugins and clipping (automatic optimization) -----------------------------------------------------------
@pytest.fixture(scope="module")
def auto_ref(lit_ref):
    if lit_ref[1]:
        pytest.skip("the automatic-optimization reference is enough")
    return lit_ref[0]


def test_16_mixed_with_its_grad_scaler_is_recorded_unscaled_and_matches(auto_ref, tmp_path):
    """Lightning's `16-mixed` multiplies the loss by its GradScaler's scale (2**16 at first) before backward; told
    the scale, the Recorder stores the loss and every gradient divided by it, exactly, as a float32 run has them.
    (On a CPU Lightning turns `precision="16-mixed"` into bf16: the plugin is given as a GPU user gets it.)"""
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=auto_ref), model_seed=3, data_seed=7,
         plugins=[plugin])
    with h5py.File(auto_ref) as a, h5py.File(tmp_path / "tgt.h5") as b:
        assert (b.attrs["amp"], b.attrs["loss_scale"]) == ("fp16", 2.0**16)
        assert float(b["loss"][()]) == pytest.approx(float(a["loss"][()]), rel=1e-2)  # unscaled
    code, verdict = compare_verdict(auto_ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    assert verdict["loss_unexplained"] is None


def test_bf16_true_is_a_match_with_every_update_judged(auto_ref, tmp_path):
    """`bf16-true` casts the module (weights, AdamW's moments) to bfloat16, no autocast: the replay loads the float32
    reference's weights and moments into it, and the shadow step of the bfloat16 AdamW judges each update."""
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=auto_ref), model_seed=3, data_seed=7,
         precision="bf16-true")
    with h5py.File(tmp_path / "tgt.h5") as f:
        assert (f.attrs["dtype"], f.attrs["amp"], f.attrs["precision"]) == ("bfloat16", "", "bf16-true")
    code, verdict = compare_verdict(auto_ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    assert (verdict["num_not_judged"], verdict["unprobed"]) == (0, [])


def test_gradient_clipping_leaves_the_update_not_probed_with_that_reason(auto_ref, tmp_path):
    """Lightning clips inside its closure, after backward: the gradients are read before clipping (every call and
    parameter gradient judged as usual), and the step used others, so the shadow step is left out with that reason.
    The updated weights are then held to their error growth alone, which AdamW's normalisation (lr 1e-2 here) can
    exceed in bf16 for rows with tiny gradients: that verdict is not asserted (a shadow step under clipping needs the
    clipped gradients in the file)."""
    _fit(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=auto_ref), model_seed=3, data_seed=7,
         precision="bf16-mixed", gradient_clip_val=0.5)
    _code, verdict = compare_verdict(auto_ref, tmp_path / "tgt.h5", tmp_path)
    assert [(u["module"], u["reason"].split(" (")[0]) for u in verdict["unprobed"]] == [CLIPPED]
    rows = oneiter.compare(auto_ref, tmp_path / "tgt.h5").rows
    assert [r.name for r in rows if r.phase != "optimizer" and r.diverged] == []
    assert verdict["num_flagged"] == 0  # no call's own code is to blame


def test_every_k_steps_records_a_multi_step_file_and_a_replay_matches(tmp_path):
    callback = _fit(tmp_path, OneIterCallback(every=2, out=tmp_path / "ref.h5"), max_steps=5)
    assert callback.summary.num_steps == 3
    _fit(tmp_path, OneIterCallback(every=2, out=tmp_path / "tgt.h5", replay=tmp_path / "ref.h5"), model_seed=3,
         max_steps=5)
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert [r.step for r in result.rows] == [0, 2, 4] and all(r.bitwise for r in result.rows)
    assert result.exit_code == 0


def test_an_exception_inside_the_recorded_step_leaves_no_file_and_no_hook(tmp_path):
    class Boom(RuntimeError):
        pass

    class Failing(lightning_llama.LitLlama):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                raise Boom("the user's training_step failed")
            return super().training_step(batch, batch_idx)

    callback = OneIterCallback(step=1, out=tmp_path / "x.h5")
    trainer = lightning_llama.pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                         enable_progress_bar=False, enable_model_summary=False,
                                         default_root_dir=str(tmp_path), callbacks=[callback])
    torch.manual_seed(0)
    module = Failing()
    with pytest.raises(Boom):
        trainer.fit(module, lightning_llama.loader(0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".h5" or ".tmp-" in p.name) == []
    assert "training_step" not in module.__dict__ and torch.Tensor.backward.__module__ == "torch._tensor"
    assert not any(len(m._forward_pre_hooks) for m in module.modules())


def test_callback_arguments_are_checked(tmp_path, auto_ref):
    ref = auto_ref
    with pytest.raises(OneIterError, match="give step .* or every"):
        OneIterCallback(out=tmp_path / "x.h5")
    with pytest.raises(OneIterError, match="already exists; pass force=True"):
        OneIterCallback(step=0, out=ref)
    with pytest.raises(OneIterError, match="takes options= or the recording.s keywords"):
        OneIterCallback(step=0, out=tmp_path / "x.h5", options=RecordOptions(out=tmp_path / "y.h5"))
    with pytest.raises(OneIterError, match="step must be below the run's 4 steps, got 9"):
        _fit(tmp_path, OneIterCallback(step=9, out=tmp_path / "late.h5"))
    # a RecordOptions given whole: its settings are the recording's
    callback = OneIterCallback(step=0, options=RecordOptions(out=tmp_path / "o.h5", include=["layers\\.0"]))
    _fit(tmp_path, callback, max_steps=1)
    with h5py.File(tmp_path / "o.h5") as f:
        assert {f["calls"][k].attrs["module"].split(".layers.")[1][0] for k in f["calls"]} == {"0"}


# -- gradient accumulation: optimizer step 1 is two batches -----------------------------------------------------------
@pytest.fixture(scope="module")
def accumulated_ref(tmp_path_factory):
    """Optimizer step 1 of a run with `accumulate_grad_batches=2`: batches 2 and 3, each its own training_step and
    backward, then AdamW's step, recorded as one iteration of two microbatches."""
    tmp = tmp_path_factory.mktemp("lightning_accumulated")
    _fit(tmp, OneIterCallback(step=1, out=tmp / "ref.h5"), accumulate_grad_batches=2, max_steps=2)
    return tmp / "ref.h5"


def test_a_step_of_two_batches_is_one_recording_of_two_microbatches(accumulated_ref):
    with h5py.File(accumulated_ref) as f:
        assert (f.attrs["microbatches"], f.attrs["iteration"]) == (2, 1)
        assert [(f["batch"][n].attrs["arg"], f["batch"][n].attrs.get("microbatch", 0)) for n in sorted(f["batch"])] \
            == [("input.0.0", 0), ("input.0.0", 1)]  # each training_step's batch


@pytest.mark.parametrize("precision,fault", [("bf16-mixed", ""), ("32-true", FAULT)], ids=["bf16_clean", "fault"])
def test_an_accumulated_step_replays_clean_and_names_a_fault(accumulated_ref, tmp_path, monkeypatch, precision,
                                                              fault):
    if fault:
        monkeypatch.setenv(FAULT_ENV, fault)
    _fit(tmp_path, OneIterCallback(step=1, out=tmp_path / "tgt.h5", replay=accumulated_ref), model_seed=3,
         data_seed=7, accumulate_grad_batches=2, max_steps=2, precision=precision)
    code, verdict = compare_verdict(accumulated_ref, tmp_path / "tgt.h5", tmp_path)
    if not fault:
        assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
        assert verdict["num_not_judged"] == 0
    else:
        assert (code, verdict["basis"], verdict["module"], verdict["phase"]) == (1, "local_error", CULPRIT, "forward")
        assert verdict["culprit"]["microbatch"] == 0


@pytest.mark.slow
def test_a_ddp_run_on_gloo_writes_one_file_per_rank_that_compare_rank_by_rank(tmp_path):
    """`strategy="ddp"` with 2 CPU processes: Lightning launches the second rank by running the script again; each
    rank records its own step 2 (its own batch, DDP's averaged gradients) and a replay of another run matches rank by
    rank."""
    script = MODEL_FILES / "lightning_llama.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for args in (["--out", tmp_path / "ref.h5"],
                 ["--out", tmp_path / "tgt.h5", "--replay", tmp_path / "ref.h5", "--model-seed", "3", "--data-seed",
                  "7"]):
        res = subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True, env=env,
                             timeout=600, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == ["ref.rank0.h5", "ref.rank1.h5", "tgt.rank0.h5",
                                                              "tgt.rank1.h5"]
    with h5py.File(tmp_path / "ref.rank0.h5") as a, h5py.File(tmp_path / "ref.rank1.h5") as b:
        assert (a.attrs["world_size"], a.attrs["rank"], b.attrs["rank"]) == (2, 0, 1)
        assert not (a["batch/input.0"][()] == b["batch/input.0"][()]).all()  # each rank's own batch
    code, verdict = compare_verdict(tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"]) == (0, "match"), verdict["headline"]
    result = compare_ranks(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert sorted(result.results) == [0, 1] and all(r.status == "match" for r in result.results.values())
