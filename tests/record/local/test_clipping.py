"""The optimizer step under gradient clipping (and unscaling), judged teacher-forced (`record/local/clipping.py`).

An own loop clips with `torch.nn.utils.clip_grad_norm_` between backward and the step (clipping active: max_norm 0.1
against a total norm of ~1): both files hold the gradients as the step saw them (`/step_grads`, with the coefficient
and the norms), the clipping is judged as its own row (`(optimizer)@0 optimizer clip_coef`: the coefficient against
min(1, max_norm / total norm) of float64 norms) and each update from the reference's clipped gradients. Before, the
update was "not probed": a vendor AdamW with epsilon inside the square root came out `DIVERGED (unattributed) at 0@0
optimizer weight` in float32 and a MATCH under bf16, and a clipping whose total norm is 1 % off was unattributed.
"""

from __future__ import annotations

import sys

import h5py
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import MODEL_FILES

import oneiter

MAX_NORM = 0.1


def _vendor(eps_inside_sqrt: bool):
    sys.path.insert(0, str(MODEL_FILES))
    try:
        from vendor_optim import VendorAdamW
    finally:
        sys.path.remove(str(MODEL_FILES))
    return lambda params: VendorAdamW(params, lr=1e-3, eps=1e-6, weight_decay=1e-2, eps_inside_sqrt=eps_inside_sqrt)


TORCH = lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=1e-2, foreach=False)  # noqa: E731


def _loop(out, make_optimizer=TORCH, *, replay=None, amp=None, clip="torch", scale=1.0):
    """One iteration of an MLP in a hand-written loop: `clip` "torch" (clip_grad_norm_), "off" (no clipping), or a
    relative error of the total norm a faulty clipping uses; `scale`: the loss scaled by it and the gradients
    unscaled in place before clipping (a GradScaler's `unscale_`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = make_optimizer(model.parameters())
    with oneiter.Recorder(model, out, optimizer=opt, replay=replay, amp=amp, force=True) as rec:
        opt.zero_grad()
        xb, yb = rec.inputs(x, y)
        loss = F.cross_entropy(model(xb), yb)
        if scale != 1.0:
            rec.loss_scale(scale)
        (loss * scale).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if scale != 1.0:
            for p in params:
                p.grad.div_(scale)
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        elif clip != "off":  # a vendor's clipping whose total norm is off by `clip`
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            coefficient = torch.clamp(MAX_NORM / (total * (1 + clip) + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coefficient)
        opt.step()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip") / "ref.h5"
    _loop(out)
    return out


def _verdict(ref, tmp_path, *args, **kwargs):
    _loop(tmp_path / "tgt.h5", *args, replay=ref, **kwargs)
    return oneiter.compare(ref, tmp_path / "tgt.h5").verdict_obj


def test_the_step_gradients_and_the_coefficient_are_recorded(ref):
    with h5py.File(ref) as f:
        coefficient, grad_norm, step_norm = (f["step_grads"].attrs[k] for k in ("coefficient", "grad_norm",
                                                                                 "step_norm"))
        assert sorted(f["step_grads"]) == sorted(f["param_grads"])
        clipped = f["step_grads/0.weight"][()]
        assert torch.allclose(torch.from_numpy(clipped), coefficient * torch.from_numpy(f["param_grads/0.weight"][()]))
    assert 0 < coefficient < 1 and step_norm == pytest.approx(MAX_NORM, rel=1e-5)
    assert coefficient * (grad_norm + 1e-6) == pytest.approx(MAX_NORM, rel=1e-6)


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_a_clean_replay_judges_the_clipping_and_every_update(ref, tmp_path, amp):
    verdict = _verdict(ref, tmp_path, amp=amp)
    assert verdict.status == "match" and verdict.unprobed == (), verdict.headline
    assert verdict.num_local == 15  # 10 calls' tensors and parameter gradients, 4 updates, the clipping


def test_the_correct_vendor_adamw_matches(ref, tmp_path):
    verdict = _verdict(ref, tmp_path, _vendor(False))
    assert verdict.status == "match", verdict.headline


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_a_vendor_adamw_with_epsilon_inside_the_square_root_is_the_culprit(ref, tmp_path, amp):
    culprit = _verdict(ref, tmp_path, _vendor(True), amp=amp).culprit
    assert (culprit.module, culprit.call, culprit.phase, culprit.tensor) == ("0", 0, "optimizer", "weight")
    assert culprit.ratio > 100


def test_a_clipping_whose_total_norm_is_one_percent_off_is_named_as_the_clipping(ref, tmp_path):
    verdict = _verdict(ref, tmp_path, clip=0.01)
    culprit = verdict.culprit
    assert (culprit.module, culprit.phase, culprit.tensor) == ("(optimizer)", "optimizer", "clip_coef")
    assert culprit.local_rel_l2 == pytest.approx(0.01 / 1.01, rel=1e-3) and culprit.ratio > 100
    assert verdict.headline.startswith("DIVERGED: culprit (optimizer)@0 optimizer clip_coef: the coefficient the "
                                       "gradient clipping applied is rel 9.90e-03 off")


def test_a_target_that_does_not_clip_where_the_reference_did_is_named_as_the_clipping(ref, tmp_path):
    culprit = _verdict(ref, tmp_path, clip="off").culprit
    assert (culprit.module, culprit.tensor) == ("(optimizer)", "clip_coef") and culprit.local_rel_l2 > 1


def test_unscaled_gradients_then_clipped_are_judged_against_the_files_unscaled_ones(tmp_path):
    """A loss scaled by 1024, the gradients unscaled in place, then clipped: the file holds the unscaled gradients
    (`rec.loss_scale`), and the coefficient is the clipping's alone."""
    _loop(tmp_path / "scaled_ref.h5", scale=1024.0)
    with h5py.File(tmp_path / "scaled_ref.h5") as f:
        assert f["step_grads"].attrs["step_norm"] == pytest.approx(MAX_NORM, rel=1e-5)
    _loop(tmp_path / "tgt.h5", replay=tmp_path / "scaled_ref.h5", scale=1024.0)
    verdict = oneiter.compare(tmp_path / "scaled_ref.h5", tmp_path / "tgt.h5").verdict_obj
    assert verdict.status == "match" and verdict.unprobed == (), verdict.headline
