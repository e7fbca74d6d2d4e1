"""A replay whose optimizer keeps the reference's state under other names or places (`record/start/state_names.py`).

The reference steps torch's AdamW (its state: `step`, `exp_avg`, `exp_avg_sq` per parameter); the target a vendor's
Adam keeping `m` and `v` (`vendor_optim.VendorAdamMV`), or its step count in the param group as apex's FusedAdam does
(`vendor_optim.GroupStepAdamW`). Loaded as recorded, the user's own step raised `KeyError: 'm'` from inside the
optimizer. Now: mapped where the table of classes holding Adam's quantities knows both classes, and the update
judged; else one line before the step runs, naming both classes and both sets of names (exit 2 from the CLI).
"""

from __future__ import annotations

import sys

import h5py
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import MODEL_FILES, run_cli

import oneiter
from oneiter.errors import OneIterError
from oneiter.record.start import state_names

sys.path.insert(0, str(MODEL_FILES))
import vendor_optim  # noqa: E402

sys.path.remove(str(MODEL_FILES))

VENDOR_NAMES = {"step": "step", "exp_avg": "m", "exp_avg_sq": "v"}
GROUP_STEP = {"step": "group:step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _loop(out, kind=torch.optim.AdamW, replay=None):
    """Step 0 plainly, step 1 recorded (the optimizer holds Adam's moments and a step count by then)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = kind(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=1e-2)
    for step in range(2):
        recorder = oneiter.Recorder(model, out, optimizer=opt, replay=replay, force=True) if step else None
        with recorder if recorder is not None else torch.enable_grad() as rec:
            opt.zero_grad()
            xb, yb = rec.inputs(x, y) if recorder is not None else (x, y)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    return opt


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("names") / "ref.h5"
    _loop(out)
    return out


def test_a_vendor_adam_keeping_other_names_is_refused_in_one_line_before_its_step(ref, tmp_path):
    with pytest.raises(OneIterError) as raised:
        _loop(tmp_path / "tgt.h5", vendor_optim.VendorAdamMV, replay=ref)
    assert str(raised.value) == (
        "the target's optimizer VendorAdamMV keeps its state as {m, step, v}, the reference's AdamW as {exp_avg, "
        "exp_avg_sq, step}: a replay cannot load one into the other, and oneiter maps only classes known to hold the "
        "same quantities (torch.optim.adam.Adam, torch.optim.adamw.AdamW, apex.optimizers.fused_adam.FusedAdam; a "
        "vendor's class is one row of KNOWN in oneiter/record/start/state_names.py)")
    assert not (tmp_path / "tgt.h5").exists()


@pytest.mark.parametrize("kind,where", [(vendor_optim.VendorAdamMV, VENDOR_NAMES),
                                        (vendor_optim.GroupStepAdamW, GROUP_STEP)], ids=["m-v", "group-step"])
def test_a_class_the_table_knows_gets_the_state_where_it_keeps_it_and_is_judged(ref, tmp_path, monkeypatch, kind,
                                                                                where):
    monkeypatch.setitem(state_names.KNOWN, f"vendor_optim.{kind.__qualname__}", where)
    opt = _loop(tmp_path / "tgt.h5", kind, replay=ref)
    if kind is vendor_optim.GroupStepAdamW:
        assert [g["step"] for g in opt.param_groups] == [2]  # the reference's 1, stepped once
    with h5py.File(tmp_path / "tgt.h5") as f:
        assert f.attrs["optimizer_state"] == "loaded"
        moved = {k: v for k, v in where.items() if k != v}
        assert f.attrs["optimizer_state_names"] == "{" + ", ".join(
            f'"{theirs}": "{ours}"' for ours, theirs in sorted(moved.items(), key=lambda kv: kv[1])) + "}"
    result = oneiter.compare(ref, tmp_path / "tgt.h5")
    verdict = result.verdict_obj
    assert verdict.status == "match" and (verdict.num_not_judged, verdict.unprobed) == (0, ()), verdict.headline
    assert len([r for r in result.local if r.phase == "optimizer"]) == 4  # every update judged


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path, monkeypatch):
    spec = f"{MODEL_FILES / 'vendor_optim.py'}:build"
    assert run_cli("record", "-m", spec, "--step", "1", "-o", tmp_path / "ref.h5", "-q").exit_code == 0
    monkeypatch.setenv("ONEITER_TEST_FAULT", "optimizer:mv")
    res = run_cli("record", "-m", spec, "--replay", tmp_path / "ref.h5", "-o", tmp_path / "tgt.h5", "-q")
    assert res.exit_code == 2 and "KeyError" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: the target's optimizer VendorAdamMV keeps its state as {m, step, v}, the reference's AdamW as "
        "{exp_avg, exp_avg_sq, step}: a replay cannot load one into the other, and oneiter maps only classes known to "
        "hold the same quantities (torch.optim.adam.Adam, torch.optim.adamw.AdamW, apex.optimizers.fused_adam."
        "FusedAdam; a vendor's class is one row of KNOWN in oneiter/record/start/state_names.py)"]
