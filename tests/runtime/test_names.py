"""A recording names a model's parameters and buffers as the model holds them (`runtime/names.py`), never by its
`state_dict` (whose hooks may split a fused weight into tensors that are no parameter), and a wrapper such as
torch.compile's `_orig_mod` adds no level to those names."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import MODEL_FILES, compare_verdict, record_small, replay

from oneiter.format.layout import IterationFile
from oneiter.runtime.names import canonical, parameters, state_tensors, tensor_names

FUSED = f"{MODEL_FILES / 'fused_qkv.py'}:build"


def _fused():
    sys.path.insert(0, str(MODEL_FILES))
    import fused_qkv

    return fused_qkv.Block()


def test_state_dict_hooks_do_not_rename_what_is_recorded():
    model = _fused()
    saved = set(model.state_dict())
    assert "attention.wq.weight" in saved and "attention.qkv.weight" not in saved  # the hooks split it on save
    names = [name for name, _, _ in state_tensors(model)]
    assert "attention.qkv.weight" in names and "attention.wq.weight" not in names
    assert [n for n, _ in parameters(model)] == [n for n, _ in model.named_parameters()]
    # every tensor is the model's own: the same objects its parameters and buffers are
    held = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert all(id(t) in held for _, t, _ in state_tensors(model))


def test_a_non_persistent_buffer_is_left_out_as_state_dict_leaves_it_out():
    model = torch.nn.Linear(2, 2)
    model.register_buffer("kept", torch.zeros(1))
    model.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert [n for n, _, _ in state_tensors(model)] == list(model.state_dict()) == ["weight", "bias", "kept"]
    assert set(tensor_names(model).values()) == {"weight", "bias", "kept", "scratch"}


def test_wrappers_add_no_level():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    compiled = torch.compile(inner)  # an OptimizedModule; nothing compiles before its first call
    assert [n for n, _ in compiled.named_parameters()][0] == "_orig_mod.0.weight"
    assert [n for n, _, _ in state_tensors(compiled)] == list(inner.state_dict())
    assert canonical("layers.0._orig_mod.attn._checkpoint_wrapped_module.q.weight") == "layers.0.attn.q.weight"
    assert canonical("_orig_mod") == "" and canonical("layers.0.weight") == "layers.0.weight"


def test_a_fused_weight_saved_split_records_replays_and_compares(tmp_path):
    """A model whose state_dict hooks split its fused QKV weight (torchtitan's default): recorded under its
    parameters' names, replayed (the reference's weights loaded by those names) and compared: a MATCH."""
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, FUSED)
    with IterationFile(ref) as f:
        assert "attention.qkv.weight" in f.state() and "attention.wq.weight" not in f.state()
    replay(ref, tgt)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict


@pytest.mark.parametrize("amp", ["bf16"])
def test_the_same_under_bf16(tmp_path, amp):
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, FUSED)
    replay(ref, tgt, amp=amp)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match", verdict
