"""A rerun counts only where it reproduces the live call: fault shapes a contiguous rerun or a rebuilt optimizer
would miss (a kernel wrong only for strided inputs, forward or backward; an optimizer option that lives in an
instance attribute), benign differences that must stay a MATCH (a vendor optimizer's own arithmetic), and what
the report says when the rerun machinery cannot reproduce a call (`oneiter/record/local/fidelity.py`)."""

from __future__ import annotations

import h5py
import pytest
import torch
from conftest import MODEL_FILES, compare_verdict, replay_with_fault

STRIDED = str(MODEL_FILES / "strided.py:build")
MIXER = str(MODEL_FILES / "mixer.py:build")
OPTIM = str(MODEL_FILES / "vendor_optim.py:build")


NAMED = [
    # a Linear fed h[:, 1:].transpose(1, 2) (strides and a storage offset): wrong only there, forward or backward
    (STRIDED, "stride:linear", ("blocks.0.fc", 0, "forward", "output")),
    (STRIDED, "stride_bwd:linear", ("blocks.1.fc", 0, "backward", "grad_input.0")),
    # the MLP-Mixer's token mixing: fc1 gets the transposed layer-norm output
    (MIXER, "stride:linear", ("layers.0.token_mix.fc1", 0, "forward", "output")),
    # an optimizer whose constructor option (an instance attribute, not a param-group key) changes its math
    (OPTIM, "optimizer:eps_inside_sqrt", ("0", 0, "optimizer", "weight")),
]


@pytest.mark.parametrize("spec,fault,expected", NAMED, ids=[f for _, f, _ in NAMED])
def test_fault_shapes_are_named_where_they_live(spec, fault, expected, references, tmp_path, monkeypatch):
    ref, tgt = references(spec), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, fault, monkeypatch)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    culprit = verdict["culprit"]
    assert code == 1 and verdict["basis"] == "local_error", verdict
    assert (culprit["module"], culprit["call"], culprit["phase"], culprit["tensor"]) == expected
    assert culprit["ratio"] > 4 and verdict["unprobed"] == []


@pytest.mark.parametrize("spec,fault", [(STRIDED, ""), (OPTIM, ""), (OPTIM, "optimizer:vendor")],
                         ids=["strided-clean", "torch-adamw", "vendor-adamw-own-arithmetic"])
def test_benign_targets_stay_a_match(spec, fault, references, tmp_path, monkeypatch):
    ref, tgt = references(spec), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, fault, monkeypatch)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match" and verdict["unprobed"] == [], verdict
    with h5py.File(tgt) as f:
        phases = {row["phase"].decode() for row in f["local"][()]}
    assert "optimizer" in phases if spec == OPTIM else "forward" in phases


def test_strides_and_storage_offsets_are_recorded(references):
    with h5py.File(references(STRIDED)) as f:
        strided = f["calls/blocks.0.fc@0/forward/input.0"]
        plain = f["calls/blocks.0.proj@0/forward/input.0"]
        assert list(strided.attrs["stride"]) == [56, 1, 8] and strided.attrs["storage_offset"] == 8
        assert "stride" not in plain.attrs and "storage_offset" not in plain.attrs


def test_a_rerun_that_does_not_reproduce_the_call_is_never_cleared(references, tmp_path, monkeypatch):
    """Without layout-faithful reruns the stride fault never fires in the rerun: the fidelity check sees the rerun
    miss the live output, lists the call as not reproducible, and the caller whose rerun contains it is named."""
    import oneiter.record.local.rerun as rerun

    monkeypatch.setattr(rerun, "with_layout", lambda value, layout: value)
    ref, tgt = references(STRIDED), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, "stride:linear", monkeypatch)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 1 and verdict["culprit"]["module"] == "blocks.0" and verdict["culprit"]["phase"] == "forward"
    [unprobed] = verdict["unprobed"]
    assert (unprobed["module"], unprobed["call"]) == ("blocks.0.fc", 0)
    assert unprobed["reason"].startswith("not reproducible from its inputs: its rerun on the reference's values")


def test_a_backward_the_rerun_does_not_reproduce_is_named_by_error_growth(references, tmp_path, monkeypatch):
    """The same without layouts, for a kernel wrong only in its strided backward: fed exactly the reference's
    values, the live backward gives another input gradient than the rerun's; the call is not reproducible, and its
    gradient (1e-3 off, from gradients bitwise equal to the reference's) is named although inside tolerance."""
    import oneiter.record.local.rerun as rerun

    monkeypatch.setattr(rerun, "with_layout", lambda value, layout: value)
    ref, tgt = references(STRIDED), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, "stride_bwd:linear", monkeypatch)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 1 and verdict["basis"] == "unattributed", verdict
    assert (verdict["module"], verdict["call"], verdict["phase"], verdict["tensor"]) == (
        "blocks.1.fc", 0, "backward", "grad_input.0")
    [unprobed] = verdict["unprobed"]
    assert (unprobed["module"], unprobed["call"]) == ("blocks.1.fc", 0)
    assert "its live backward gives another grad_input.0 than its rerun" in unprobed["reason"]


def test_an_update_a_copy_cannot_reproduce_is_no_drift(references, tmp_path, monkeypatch):
    """A copy of the optimizer that lost its option: the live update differs from the checked shadow step, the
    rows go, and the update (from weights and gradients bitwise equal to the reference's) is unattributed, never
    drift."""
    import oneiter.record.local.optimizer_rows as rows

    original = rows.faithful_copy

    def lossy(opt, shadows, *, plain=False):
        copy = original(opt, shadows, plain=plain)
        copy.eps_inside_sqrt = False
        return copy

    monkeypatch.setattr(rows, "faithful_copy", lossy)
    ref, tgt = references(OPTIM), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, "optimizer:eps_inside_sqrt", monkeypatch)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 1 and verdict["basis"] == "unattributed", verdict
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == ("0", "optimizer", "weight")
    assert "bitwise equal" in verdict["reason"]
    assert {u["module"] for u in verdict["unprobed"]} == {"(optimizer)"} and len(verdict["unprobed"]) == 4


def test_a_faithful_copy_keeps_instance_options_and_never_touches_the_original():
    import sys

    sys.path.insert(0, str(MODEL_FILES))
    from vendor_optim import VendorAdamW

    from oneiter.record.local.optimizer_rows import faithful_copy

    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    opt = VendorAdamW([p], lr=0.1, eps_inside_sqrt=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps opt.step in an instance attribute bound to opt
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    copy = faithful_copy(opt, {id(p): q})
    assert type(copy) is VendorAdamW and copy.eps_inside_sqrt is True and "step" not in vars(copy)
    assert copy.param_groups[0]["params"] == [q] and copy.param_groups[0]["lr"] == 0.1
    before = p.detach().clone()
    copy.step()
    assert torch.equal(p.detach(), before) and not torch.equal(q.detach(), before) and not opt.state
    opt.step()
    assert torch.equal(p.detach(), q.detach())
    del sched


def test_an_optimizer_option_is_named_under_bf16_autocast(references, tmp_path, monkeypatch):
    """The update runs outside autocast, in the parameters' float32: its error is calibrated whenever it is above
    float32's roundoff, not only above bf16's (which hid a 1.5e-3 fault)."""
    ref, tgt = references(OPTIM), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, "optimizer:eps_inside_sqrt", monkeypatch, amp="bf16")
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    culprit = verdict["culprit"]
    assert code == 1 and (culprit["module"], culprit["phase"], culprit["tensor"]) == ("0", "optimizer", "weight")
