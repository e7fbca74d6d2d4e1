"""Activation checkpointing (`torch.utils.checkpoint`, reentrant and not, and Hugging Face's switch): a call
recomputed in backward is no new call, so a checkpointed iteration records exactly what the same iteration without
checkpointing records; recording changes no bit of it; its replays match, and a fault inside a checkpointed layer
is named with its module and phase."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import MODEL_FILES, record_small, replay, replay_with_fault

import oneiter
from oneiter.format.layout import IterationFile
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.training import prepare, train_step

HF = f"{MODEL_FILES / 'hf_llama.py'}:build"
OWN = f"{MODEL_FILES / 'checkpointed.py'}:build"
HF_ARGS = {"layers": 1, "dropout": 0.1}

# (model, model args, [(fault, the (module, call, phase) the verdict must name)]); a fault "inject:..." is oneiter's
# own --inject-fault, the others are the model file's (faultkit)
CASES = {
    "hf-non_reentrant": (HF, {**HF_ARGS, "checkpointing": "non_reentrant"},
                         [("instance:model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj", 0, "forward")),
                          ("function_bwd:silu", ("model.layers.0.mlp.act_fn", 0, "backward"))]),
    "hf-reentrant": (HF, {**HF_ARGS, "checkpointing": "reentrant"},
                     [("instance:model.layers.0.self_attn.v_proj", ("model.layers.0.self_attn.v_proj", 0, "forward")),
                      ("inject:model.layers.0.mlp.up_proj:backward", ("model.layers.0.mlp.up_proj", 0, "backward"))]),
    "own-non_reentrant": (OWN, {"checkpointing": "non_reentrant"},
                          [("instance:blocks.1.down", ("blocks.1.down", 0, "forward")),
                           ("function_bwd:gelu", ("blocks.1.act", 0, "backward"))]),
    # `squash` is called in both regions: the recomputed calls must be mapped onto the right first executions
    "own-reentrant": (OWN, {"checkpointing": "reentrant"},
                      [("instance:squash", ("squash", 0, "forward")),
                       ("inject:blocks.0.up:backward", ("blocks.0.up", 0, "backward"))]),
}


def _datasets(path) -> dict[str, bytes]:
    """Every dataset of a recording by path, hard links followed (h5py's visititems skips a second link)."""
    found = {}

    def walk(group, prefix: str) -> None:
        for name, item in group.items():
            if isinstance(item, h5py.Dataset):
                found[prefix + name] = np.asarray(item[()]).tobytes()
            else:
                walk(item, f"{prefix}{name}/")

    with h5py.File(path) as f:
        walk(f, "")
    return found


def _plain_iteration(spec: str, args: dict):
    """The iteration `record` runs, without oneiter: loss, parameter gradients, state after the step."""
    bundle = load_model(spec, 2, 0, args)
    setup = prepare(bundle, torch.device("cpu"))
    grads = {}

    def after_backward():
        grads.update({n: p.grad.clone() for n, p in bundle.model.named_parameters() if p.grad is not None})

    torch.manual_seed(0)
    loss = train_step(setup, after_backward=after_backward)
    return loss, grads, {n: t.detach().clone() for n, t in bundle.model.state_dict().items()}


def _verdict(ref, out, fault: str, monkeypatch) -> tuple:
    if fault.startswith("inject:"):
        replay(ref, out, faults=[fault.removeprefix("inject:")])
    else:
        replay_with_fault(ref, out, fault, monkeypatch)
    verdict = oneiter.compare(ref, out).verdict()
    return verdict["status"], verdict["basis"], (verdict["module"], verdict["call"], verdict["phase"])


@pytest.mark.parametrize("case", CASES)
def test_a_checkpointed_iteration_is_recorded_replayed_and_blamed_as_without_checkpointing(case, tmp_path,
                                                                                           monkeypatch):
    spec, args, faults = CASES[case]
    ref, plain = tmp_path / "ref.h5", tmp_path / "plain.h5"
    record_small(ref, spec, model_args=args)
    # the recorded forward is each call's first execution: the file holds what the same iteration without
    # checkpointing records, tensor for tensor (calls, gradients, dropout values: a recomputation adds none)
    record_small(plain, spec, model_args={**args, "checkpointing": ""})
    recorded = _datasets(ref)
    assert recorded == _datasets(plain) and len(recorded) > 50
    with IterationFile(ref) as f:
        assert f.meta["num_calls"] == IterationFile(plain).meta["num_calls"]
        # recording changed no bit of the checkpointed iteration
        loss, grads, after = _plain_iteration(spec, args)
        assert f.tensor("loss").item() == loss.item()
        assert {n: torch.equal(f.tensor(p), grads[n]) for n, p in f.state("param_grads").items()} == dict.fromkeys(
            grads, True)
        assert all(torch.equal(f.tensor(p), after[n]) for n, p in f.state("state_after").items())
        if spec == HF:
            assert f.file["random"].attrs["num_ops"] == 1  # the attention's dropout, drawn again in backward

    clean = tmp_path / "clean.h5"
    replay(ref, clean)
    result = oneiter.compare(ref, clean)
    assert result.status == "match" and all(row.metrics.max_abs == 0 for row in result.rows)
    verdict = result.verdict()
    assert verdict["unprobed"] == [] and verdict["num_local"] > 40

    replay(ref, tmp_path / "bf16.h5", amp="bf16")
    assert oneiter.compare(ref, tmp_path / "bf16.h5").verdict()["status"] == "match"

    for k, (fault, named) in enumerate(faults):
        assert _verdict(ref, tmp_path / f"fault{k}.h5", fault, monkeypatch) == ("diverged", "local_error", named)
