"""The Hugging Face Trainer callback: step 2 of a tiny random-config Llama run, reference and replays."""

from __future__ import annotations

import sys

import h5py
import pytest
import torch

pytest.importorskip("transformers")

from conftest import FAULT_ENV, MODEL_FILES  # noqa: E402

import oneiter  # noqa: E402
from oneiter.errors import OneIterError  # noqa: E402
from oneiter.integrations.hf import OneIterCallback  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, seed: int, n: int = 16, seq_len: int = 8):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 100, (n, seq_len), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, callback, *, model_seed: int, data_seed: int, steps: int = 4, **training):
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(MODEL_FILES))
    try:
        import hf_llama

        torch.manual_seed(model_seed)
        model, _inputs, _loss = hf_llama.build(2)
    finally:
        sys.path.remove(str(MODEL_FILES))
    args = TrainingArguments(
        output_dir=str(tmp_path / f"trainer-{model_seed}-{data_seed}"), max_steps=steps,
        per_device_train_batch_size=2, optim="sgd", learning_rate=0.05, report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, seed=data_seed, dataloader_num_workers=0, disable_tqdm=True, **training,
    )
    Trainer(model=model, args=args, train_dataset=_Tokens(data_seed), callbacks=[callback]).train()
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
    # the Trainer clips gradients between backward and the step: the update is said to be unjudged, not passed
    unprobed = {(u["module"], u["reason"].split(" (")[0]) for u in result.verdict()["unprobed"]}
    assert unprobed == {("(optimizer)", "the gradients changed between backward and the step")}


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


def test_callback_arguments_are_checked(tmp_path, trainer_ref):
    ref, _ = trainer_ref
    with pytest.raises(OneIterError, match="step must be a non-negative int, got -1"):
        OneIterCallback(step=-1, out=tmp_path / "x.h5")
    with pytest.raises(OneIterError, match="already exists; pass force=True"):
        OneIterCallback(step=0, out=ref)
    with pytest.raises(OneIterError, match="step must be below the run's 4 steps, got 9"):
        _train(tmp_path, OneIterCallback(step=9, out=tmp_path / "late.h5"), model_seed=0, data_seed=0)
