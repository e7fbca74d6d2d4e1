"""A rerun computes what the live call computed, bit for bit on the CPU, also where a kernel's summation order
depends on its operands' memory: the gradient a rerun backpropagates is laid out as the live one was (its strides,
recorded with it; `CallRecord.grad_layouts` while the run goes on) in a fresh buffer of torch's allocator, never
where the stored copy happens to sit in a memory-mapped file. And a buffer the call updated to exactly its start
(a running mean of a zero-mean input, under bf16) is still judged as the call's update."""

from __future__ import annotations

import h5py
import pytest
import torch
from conftest import MODEL_FILES, compare_verdict, record_small, replay

from oneiter.format.layout import IterationFile

LAYOUTS = f"{MODEL_FILES / 'layouts.py'}:build"


@pytest.fixture(scope="module")
def convnext(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "convnext.h5"
    record_small(out, LAYOUTS, model_args={"kind": "convnext", "size": 32}, threads=1, batch_size=3)
    return out


def test_a_gradient_is_stored_with_the_strides_the_live_backward_gave_it(convnext):
    with h5py.File(convnext) as f:
        grad = f["calls/blocks.0@0/backward/grad_output"]
        assert list(grad.attrs["stride"]) == [2048, 1, 128, 8] and grad.attrs["storage_offset"] == 0


@pytest.mark.parametrize("options", [{"threads": 1}, {"threads": 2}], ids=["same", "threads"])
def test_a_channels_last_gradient_is_rerun_as_it_was(convnext, tmp_path, options):
    """The layer scale's gradient, summed from a channels_last gradient, is rerun bitwise (from a contiguous copy
    of that gradient it was 6.5e-08 and 7.1e-08 off)."""
    tgt = tmp_path / "tgt.h5"
    replay(convnext, tgt, **options)
    with IterationFile(tgt) as f:
        scale = {r.module: r.rel_l2 for r in f.local_rows() if r.phase == "param_grad" and r.tensor == "scale"}
    assert scale == {"blocks.0": 0.0, "blocks.1": 0.0}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_clean_replay_of_it_is_a_match(convnext, tmp_path, threads):
    """On 2 threads too: head_norm's bias gradient sums 768 alike terms, which float32 rounds by 83 u; its bound
    (runtime/roundoff.py) was 3.7 u while the injected rounding sat on the terms only, and the noise was refused."""
    tgt = tmp_path / "tgt.h5"
    replay(convnext, tgt, threads=threads)
    code, verdict = compare_verdict(convnext, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict


def test_a_running_mean_left_at_its_start_under_bf16_is_the_calls_own_update(tmp_path):
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, LAYOUTS, model_args={"kind": "zero_mean"}, threads=1, batch_size=2)
    replay(ref, tgt, amp="bf16")
    with h5py.File(ref) as r, h5py.File(tgt) as t:
        name = "3.running_mean"
        assert r[f"state_after/{name}"][()].any() and not t[f"state_after/{name}"][()].any()
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match", verdict


def test_a_rerun_does_not_depend_on_where_the_stored_gradient_sits(tmp_path, monkeypatch):
    """A 1x1 convolution's weight gradient is rerun bitwise from a stored grad_output at any address: the file is
    memory-mapped, so a stored tensor may start anywhere (4 bytes past a 16-byte boundary here), and oneDNN sums
    the weight gradient in another order for an operand not 16-byte aligned (1.2e-07 relative)."""
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, LAYOUTS, model_args={"kind": "pointwise"}, threads=1, batch_size=2)
    stored = IterationFile.tensor

    def off_by_four_bytes(self, path):
        t = stored(self, path)
        if t.dtype != torch.float32 or t.numel() == 0:
            return t
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)
        return buf[1:].view(t.shape).copy_(t)

    monkeypatch.setattr(IterationFile, "tensor", off_by_four_bytes)
    replay(ref, tgt, threads=1)
    monkeypatch.undo()
    with IterationFile(tgt) as f:
        grads = {r.module: r.rel_l2 for r in f.local_rows() if r.phase == "param_grad" and r.tensor == "weight"}
    assert grads["2"] == 0.0, grads
