"""The Hugging Face Trainer callback: step 2 of a tiny random-config Llama run, reference and replays."""

from __future__ import annotations

import sys

import h5py
import pytest
import torch

pytest.importorskip("transformers")

from conftest import FAULT_ENV, MODEL_FILES, assert_reads_back, compare_verdict  # noqa: E402

import oneiter  # noqa: E402
from oneiter.errors import OneIterError  # noqa: E402
from oneiter.format.layout import IterationFile  # noqa: E402
from oneiter.integrations.hf import OneIterCallback  # noqa: E402
from oneiter.record.options import RecordOptions  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, seed: int, n: int = 16, seq_len: int = 8):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 100, (n, seq_len), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


SGD = {"optim": "sgd", "learning_rate": 0.05, "logging_strategy": "no", "disable_tqdm": True}


def _train(tmp_path, callback, *, model_seed: int, data_seed: int, steps: int = 4, optimizer=None,
           model: str = "hf_llama", **args):
    """A Trainer run of the tiny Llama (`model="hf_gpt2"`: the tiny GPT-2, dropout 0.1); `args`: TrainingArguments
    beyond the few a test needs (default: plain SGD, quiet; `defaults=True`: the Trainer's own defaults, AdamW and
    gradient clipping); `optimizer`: the Trainer's `optimizer_cls_and_kwargs` (a vendor's optimizer class in place of
    torch's)."""
    import importlib

    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(MODEL_FILES))
    try:
        torch.manual_seed(model_seed)
        model = importlib.import_module(model).build(2)[0]
        model = getattr(model, "gpt", model)  # GPT-2's wrapper returns the loss alone: the Trainer takes the model
    finally:
        sys.path.remove(str(MODEL_FILES))
    extra = {} if args.pop("defaults", False) else dict(SGD)
    extra.update(args)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"trainer-{model_seed}-{data_seed}"), max_steps=steps,
        per_device_train_batch_size=2, report_to="none", save_strategy="no", use_cpu=True, seed=data_seed,
        dataloader_num_workers=0, **extra,
    )
    Trainer(model=model, args=args, train_dataset=_Tokens(data_seed), callbacks=[callback],
            optimizer_cls_and_kwargs=optimizer).train()
    return callback


@pytest.fixture(scope="module")
def trainer_ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    callback = _train(tmp, OneIterCallback(step=2, out=tmp / "ref.h5", model_name="llama"), model_seed=0,
                      data_seed=0)
    return tmp / "ref.h5", callback


def test_the_callback_records_step_2_with_its_batch_as_keyword_arguments(trainer_ref):
    ref, callback = trainer_ref
    assert callback.summary.path == ref and callback.summary.num_calls > 20
    with h5py.File(ref) as f:
        names = sorted(f["batch"][n].attrs["arg"] for n in f["batch"])
        assert names == ["kwarg.input_ids", "kwarg.labels", "kwarg.num_items_in_batch"]  # the Trainer passes all three
        assert f.attrs["iteration"] == 2 and f.attrs["framework"] == "transformers" and f.attrs["model"] == "llama"
        assert f.attrs["loss"] == pytest.approx(float(f["loss"][()]), abs=0)


def test_a_clean_replay_of_another_run_is_a_match(trainer_ref, tmp_path):
    ref, _ = trainer_ref
    _train(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=ref), model_seed=3, data_seed=7)
    result = oneiter.compare(ref, tmp_path / "tgt.h5")
    assert result.status == "match"
    assert all(row.metrics.max_abs == 0 for row in result.rows)
    # the Trainer clips gradients between backward and the step: the clipping is judged as its own row, the update
    # from the reference's clipped gradients
    assert result.verdict()["unprobed"] == []
    clip = [r for r in result.local if (r.module, r.tensor) == ("(optimizer)", "clip_coef")]
    assert len(clip) == 1 and clip[0].rel_l2 < clip[0].expected  # the float32 coefficient against float64 norms


def test_a_replay_with_a_model_code_fault_names_the_layer(trainer_ref, tmp_path, monkeypatch):
    ref, _ = trainer_ref
    monkeypatch.setenv(FAULT_ENV, "instance:model.layers.1.mlp.down_proj:0.001")
    _train(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=ref), model_seed=3, data_seed=7)
    verdict = oneiter.compare(ref, tmp_path / "tgt.h5").verdict()
    assert verdict["status"] == "diverged" and verdict["basis"] == "local_error"
    assert (verdict["module"], verdict["phase"]) == ("model.layers.1.mlp.down_proj", "forward")


def test_a_replay_with_activation_checkpointing_matches_a_run_without_it(trainer_ref, tmp_path):
    """The Trainer's `gradient_checkpointing=True` recomputes every decoder layer in backward: no new call, so the
    replay records exactly the reference's calls and values."""
    ref, _ = trainer_ref
    _train(tmp_path, OneIterCallback(step=2, out=tmp_path / "tgt.h5", replay=ref), model_seed=3, data_seed=7,
           gradient_checkpointing=True)
    result = oneiter.compare(ref, tmp_path / "tgt.h5")
    assert result.status == "match" and all(row.metrics.max_abs == 0 for row in result.rows)
    assert result.verdict()["num_local"] > 100


def test_the_callbacks_file_reads_back(trainer_ref):
    """`inspect`, `compare` and `replay --layer` (with the model file that builds the Trainer's model) take it."""
    ref, _ = trainer_ref
    assert_reads_back(ref, "model.layers.0", f"{MODEL_FILES / 'hf_llama.py'}:build")


# -- torch_compile=True: accelerate's torch.compile(model), with dropout ----------------------------------------------
@pytest.fixture(scope="module")
def gpt2_ref(tmp_path_factory):
    """Step 2 of an eager Trainer run of the tiny GPT-2 with dropout (0.1 everywhere), recorded once."""
    tmp = tmp_path_factory.mktemp("hf_gpt2")
    _train(tmp, OneIterCallback(step=2, out=tmp / "ref.h5"), model_seed=0, data_seed=0, model="hf_gpt2")
    return tmp / "ref.h5"


@pytest.mark.slow  # inductor compiles the model twice (~10 s each on 2 cores)
def test_a_compiled_trainer_run_with_dropout_replays_an_eager_reference(gpt2_ref, tmp_path, monkeypatch):
    """`torch_compile=True`: the callback records the model the Trainer calls (accelerate's compiled one, a block),
    its dropout drawn through aten ops from the first compile on (inductor's `fallback_random`) and given the
    reference's masks: a clean replay matches, and a wrong gelu inside the compiled code is named at the block."""
    _train(tmp_path, OneIterCallback(step=2, out=tmp_path / "clean.h5", replay=gpt2_ref), model_seed=3, data_seed=7,
           model="hf_gpt2", torch_compile=True)
    with h5py.File(tmp_path / "clean.h5") as f:
        compiled = __import__("json").loads(f.attrs["compiled"])
    assert list(compiled["blocks"]) == [""] and compiled["random_ops"] == 7  # embedding, 2 x (attention, 2 residual)
    code, verdict = compare_verdict(gpt2_ref, tmp_path / "clean.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    monkeypatch.setenv(FAULT_ENV, "function:gelu:0.01")
    _train(tmp_path, OneIterCallback(step=2, out=tmp_path / "fault.h5", replay=gpt2_ref), model_seed=3, data_seed=7,
           model="hf_gpt2", torch_compile=True)
    code, verdict = compare_verdict(gpt2_ref, tmp_path / "fault.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (1, "diverged", "local_error"), verdict["headline"]
    assert (verdict["module"], verdict["phase"]) == ("(root)", "forward")


def test_callback_arguments_are_checked(tmp_path, trainer_ref):
    ref, _ = trainer_ref
    with pytest.raises(OneIterError, match="step must be a non-negative int, got -1"):
        OneIterCallback(step=-1, out=tmp_path / "x.h5")
    with pytest.raises(OneIterError, match="already exists; pass force=True"):
        OneIterCallback(step=0, out=ref)
    with pytest.raises(OneIterError, match="step must be below the run's 4 steps, got 9"):
        _train(tmp_path, OneIterCallback(step=9, out=tmp_path / "late.h5"), model_seed=0, data_seed=0)


def test_callback_takes_its_settings_as_record_options(tmp_path, trainer_ref):
    """`options=RecordOptions(...)`: the settings of `oneiter.Recorder`, here a statistics-level replay with the
    file's own model name; the Trainer's autocast is no setting of the callback."""
    ref, _ = trainer_ref
    options = RecordOptions(out=tmp_path / "stats.h5", replay=ref, level="stats", name="llama")
    _train(tmp_path, OneIterCallback(step=2, options=options), model_seed=3, data_seed=7)
    with h5py.File(tmp_path / "stats.h5", "r") as f:
        assert (f.attrs["level"], f.attrs["model"], f.attrs["framework"]) == ("stats", "llama", "transformers")
    assert oneiter.compare(ref, tmp_path / "stats.h5").status == "match"
    with pytest.raises(OneIterError, match="takes options= or the recording's keywords"):
        OneIterCallback(step=2, options=options, force=True)
    with pytest.raises(OneIterError, match="amp is the training framework's own"):
        OneIterCallback(step=2, options=RecordOptions(out=tmp_path / "x.h5", amp="bf16"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'seeds'"):
        OneIterCallback(step=2, out=tmp_path / "x.h5", seeds=3)


# -- the Trainer with its defaults (AdamW, gradient clipping), as the README's example runs it ------------------------
@pytest.fixture(scope="module")
def defaults_ref(tmp_path_factory):
    """Step 1 (AdamW has moments from step 0 by then) of a default-argument Trainer run, recorded once."""
    tmp = tmp_path_factory.mktemp("hf_defaults")
    _train(tmp, OneIterCallback(step=1, out=tmp / "ref.h5"), model_seed=0, data_seed=0, steps=2, defaults=True)
    return tmp / "ref.h5"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_clean_replay_under_the_trainers_defaults_is_a_match(defaults_ref, tmp_path, bf16, recwarn):
    """AdamW's moments and step count from step 0 are in the reference; the replay's optimizer loads them, so its
    update at step 1 starts where the reference's did (no `not_judged` row, no warning). The Trainer clips the
    gradients between backward and the step: both files hold them as the step saw them (`/step_grads`), the
    clipping is judged as its own row and the update from the reference's clipped gradients."""
    _train(tmp_path, OneIterCallback(step=1, out=tmp_path / "tgt.h5", replay=defaults_ref), model_seed=3,
           data_seed=7, steps=2, defaults=True, bf16=bf16)
    with h5py.File(defaults_ref) as ref, h5py.File(tmp_path / "tgt.h5") as tgt:
        assert (ref.attrs["optimizer_state"], tgt.attrs["optimizer_state"]) == ("recorded", "loaded")
        assert len(ref["optimizer_state"]) == 3 * 21  # step, exp_avg, exp_avg_sq of each of the 21 parameters
    code, verdict = compare_verdict(defaults_ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    assert (verdict["warnings"], verdict["num_not_judged"], verdict["num_diverged"]) == ([], 0, 0)
    assert verdict["unprobed"] == []
    result = oneiter.compare(defaults_ref, tmp_path / "tgt.h5")
    with h5py.File(defaults_ref) as ref:
        assert 0 < ref["step_grads"].attrs["coefficient"] < 1  # the clipping was active
    assert [(r.module, r.tensor) for r in result.local if r.phase == "optimizer"][0] == ("(optimizer)", "clip_coef")
    if bf16:  # the loss and its logits: the same entries on both sides, whatever the precision
        keys = {(r.module, r.phase, r.tensor): r.status for r in result.rows if r.module == "(root)"}
        assert keys[("(root)", "backward", "grad_output.logits")] == "match"
        assert result.verdict_obj.num_drift > 0  # bf16 drifts, and the verdict does not rest on it
    else:  # every value, the updates included, bit for bit: AdamW started from the reference's moments
        assert all(r.metrics.max_abs == 0 for r in result.rows)
    assert not [w for w in recwarn.list if "updates not judged" in str(w.message)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_fault_in_the_model_file_is_named_under_the_trainers_defaults(defaults_ref, tmp_path, monkeypatch, bf16):
    monkeypatch.setenv(FAULT_ENV, "instance:model.layers.1.mlp.down_proj:0.05")
    _train(tmp_path, OneIterCallback(step=1, out=tmp_path / "tgt.h5", replay=defaults_ref), model_seed=3,
           data_seed=7, steps=2, defaults=True, bf16=bf16)
    code, verdict = compare_verdict(defaults_ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"], verdict["focus"]) == (1, "diverged", "local_error", "culprit")
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == ("model.layers.1.mlp.down_proj", "forward",
                                                                        "output")
    assert verdict["headline"].startswith("DIVERGED: culprit model.layers.1.mlp.down_proj@0 forward output")



@pytest.mark.parametrize("eps_inside_sqrt", [False, True], ids=["vendor", "eps_inside_sqrt"])
def test_a_vendors_adamw_under_the_trainers_defaults_is_judged_on_the_clipped_gradients(defaults_ref, tmp_path,
                                                                                        eps_inside_sqrt):
    """The Trainer's defaults clip the gradients (max_grad_norm 1.0, active here) before AdamW steps. A vendor's AdamW
    (`vendor_optim.VendorAdamW`: its own order of operations) replayed against torch's is a MATCH; with epsilon inside
    the square root it is the culprit, at its update (phase `optimizer`), with its ratio."""
    sys.path.insert(0, str(MODEL_FILES))
    try:
        from vendor_optim import VendorAdamW
    finally:
        sys.path.remove(str(MODEL_FILES))
    options = {"lr": 5e-5, "eps": 1e-8, "weight_decay": 0.0, "eps_inside_sqrt": eps_inside_sqrt}
    _train(tmp_path, OneIterCallback(step=1, out=tmp_path / "tgt.h5", replay=defaults_ref), model_seed=3,
           data_seed=7, steps=2, defaults=True, optimizer=(VendorAdamW, options))
    code, verdict = compare_verdict(defaults_ref, tmp_path / "tgt.h5", tmp_path)
    if not eps_inside_sqrt:
        assert (code, verdict["status"], verdict["unprobed"]) == (0, "match", []), verdict["headline"]
        return
    assert (code, verdict["status"], verdict["basis"], verdict["phase"]) == (1, "diverged", "local_error", "optimizer")
    assert verdict["culprit"]["ratio"] > 4 and verdict["headline"].startswith(
        f"DIVERGED: culprit {verdict['module']}@0 optimizer {verdict['tensor']}")


def test_every_k_steps_records_the_statistics_of_those_steps_and_a_replay_matches(tmp_path):
    """`every=2` over 5 steps: steps 0, 2 and 4 in one multi-step file; a replay (other initial weights, the same
    data pipeline: the steps in between are the target's own) starts from the reference's state at step 0 and takes
    its batches at 0, 2, 4. No twin in a Trainer: the steps are held to the tolerance, and the verdict says so."""
    callback = _train(tmp_path, OneIterCallback(every=2, out=tmp_path / "ref.h5"), model_seed=0, data_seed=0,
                      steps=5)
    assert callback.summary.num_steps == 3
    _train(tmp_path, OneIterCallback(every=2, out=tmp_path / "tgt.h5", replay=tmp_path / "ref.h5"), model_seed=3,
           data_seed=0, steps=5)
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert [r.step for r in result.rows] == [0, 2, 4] and all(r.bitwise for r in result.rows)
    verdict = result.verdict()
    assert (result.exit_code, verdict["basis"]) == (0, "tolerance")
    assert any("has no twin" in w for w in verdict["warnings"])
    with pytest.raises(OneIterError, match="give step .* or every"):
        OneIterCallback(step=1, every=2, out=tmp_path / "x.h5")


# -- gradient accumulation: a step of two microbatches ---------------------------------------------------------------
@pytest.fixture(scope="module")
def accumulated_ref(tmp_path_factory):
    """Step 1 of a default-argument Trainer run with `gradient_accumulation_steps=2`: its two microbatches (each a
    forward and a backward), the clipping and AdamW's step, recorded as one iteration."""
    tmp = tmp_path_factory.mktemp("hf_accumulated")
    _train(tmp, OneIterCallback(step=1, out=tmp / "ref.h5"), model_seed=0, data_seed=0, steps=2, defaults=True,
           gradient_accumulation_steps=2)
    return tmp / "ref.h5"


def test_a_step_of_two_microbatches_is_one_recording(accumulated_ref):
    with h5py.File(accumulated_ref) as f:
        assert f.attrs["microbatches"] == 2 and f["microbatch_loss"].shape == (2,)
        batch = [(f["batch"][n].attrs["arg"], f["batch"][n].attrs.get("microbatch", 0)) for n in sorted(f["batch"])]
        assert sorted(batch) == [(name, m) for name in ("kwarg.input_ids", "kwarg.labels", "kwarg.num_items_in_batch")
                                 for m in (0, 1)]
        # the Trainer's loss of each microbatch is normalised by the step's label count: their sum is the step's
        assert float(f["loss"][()]) == pytest.approx(float(f["microbatch_loss"][()].sum()), rel=1e-6)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_clean_replay_of_an_accumulated_step_is_a_match(accumulated_ref, tmp_path, bf16):
    _train(tmp_path, OneIterCallback(step=1, out=tmp_path / "tgt.h5", replay=accumulated_ref), model_seed=3,
           data_seed=7, steps=2, defaults=True, gradient_accumulation_steps=2, bf16=bf16)
    code, verdict = compare_verdict(accumulated_ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    assert verdict["unprobed"] == []  # the clipped step judged from the reference's clipped gradients
    if not bf16:  # both microbatches' batches swapped in, the gradients accumulated the same way: bit for bit
        assert all(r.metrics.max_abs == 0 for r in oneiter.compare(accumulated_ref, tmp_path / "tgt.h5").rows)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_fault_in_an_accumulated_step_is_named_with_its_microbatch(accumulated_ref, tmp_path, monkeypatch, bf16):
    monkeypatch.setenv(FAULT_ENV, f"instance:model.layers.1.mlp.down_proj:{0.05 if bf16 else 0.001}")
    _train(tmp_path, OneIterCallback(step=1, out=tmp_path / "tgt.h5", replay=accumulated_ref), model_seed=3,
           data_seed=7, steps=2, defaults=True, gradient_accumulation_steps=2, bf16=bf16)
    code, verdict = compare_verdict(accumulated_ref, tmp_path / "tgt.h5", tmp_path)
    assert (code, verdict["basis"], verdict["focus"]) == (1, "local_error", "culprit")
    assert (verdict["module"], verdict["phase"], verdict["culprit"]["microbatch"]) == (
        "model.layers.1.mlp.down_proj", "forward", 0)


def test_every_step_of_two_microbatches_is_screened_and_a_replay_matches(tmp_path):
    """`every=1` with `gradient_accumulation_steps=2`: each recorded step of the multi-step file holds both
    microbatches; a replay takes each step's two batches and matches bit for bit."""
    _train(tmp_path, OneIterCallback(every=1, out=tmp_path / "ref.h5"), model_seed=0, data_seed=0, steps=2,
           gradient_accumulation_steps=2)
    _train(tmp_path, OneIterCallback(every=1, out=tmp_path / "tgt.h5", replay=tmp_path / "ref.h5"), model_seed=3,
           data_seed=7, steps=2, gradient_accumulation_steps=2)
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert [r.step for r in result.rows] == [0, 1] and all(r.bitwise for r in result.rows)
    with IterationFile(tmp_path / "tgt.h5") as f:
        assert [f.step(s).microbatches() for s in f.steps()] == [2, 2]
