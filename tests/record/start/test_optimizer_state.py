"""The optimizer's starting state (`format/optimizer_state.py`, `record/start/optimizer_start.py`): a recording holds
the state its optimizer began the step with, a replay loads it, and the update of a step recorded after others (SGD's
momentum) is then judged exactly; a reference that does not hold it (older files) leaves the updates `not_judged`,
and the verdict says why, in one line."""

from __future__ import annotations

import warnings

import pytest
import torch

import oneiter
from oneiter.format.layout import IterationFile
from oneiter.format.optimizer_state import (
    EMPTY,
    LOADED,
    NOT_RECORDED,
    OPTIMIZER_STATE,
    RECORDED,
    state_of,
    updates_not_judged,
)


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _record(out, *, warm: int, seed: int, replay=None, lr: float = 0.1, optimizer=torch.optim.SGD):
    """A momentum-SGD model after `warm` plain steps of its own, then one recorded step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = optimizer(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    for _ in range(warm):
        _step(model, opt, x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with oneiter.Recorder(model, out, optimizer=opt, replay=replay) as rec:
            opt.zero_grad()
            xb, yb = rec.inputs(x, y)  # labels are batch too
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return [str(w.message) for w in caught]


def test_the_attribute_and_the_rule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    assert (state_of([]), state_of([opt])) == ("", EMPTY)
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    assert state_of([opt]) == NOT_RECORDED
    assert updates_not_judged(EMPTY, EMPTY) is None and updates_not_judged("", EMPTY) is None  # older files: as before
    assert updates_not_judged(RECORDED, LOADED) is None  # the replay loaded the reference's recorded state
    assert updates_not_judged(EMPTY, NOT_RECORDED, "sgd").startswith("updates not judged: the target's optimizer (sgd)")
    assert updates_not_judged(NOT_RECORDED, EMPTY).startswith("updates not judged: the reference's optimizer")


@pytest.mark.parametrize("warm_ref, warm_tgt", [(2, 2), (2, 0)], ids=["both-stateful", "reference-stateful"])
def test_a_step_after_others_replays_exactly_from_the_recorded_state(tmp_path, warm_ref, warm_tgt):
    """The reference's momentum buffers are in its file; the replay loads them (whatever its own optimizer held:
    its own momentum from two other steps, or none), so every update is the reference's bit for bit."""
    assert _record(tmp_path / "ref.h5", warm=warm_ref, seed=0) == []
    assert _record(tmp_path / "tgt.h5", warm=warm_tgt, seed=5, replay=tmp_path / "ref.h5") == []
    with IterationFile(tmp_path / "ref.h5") as ref, IterationFile(tmp_path / "tgt.h5") as tgt:
        assert (ref.meta[OPTIMIZER_STATE], tgt.meta[OPTIMIZER_STATE]) == (RECORDED, LOADED)
        names = sorted(ref._names_in("optimizer_state"))
        assert names == [f"{i}.{p}.momentum_buffer" for i in (0, 2) for p in ("bias", "weight")]
        for name in names:  # the target's file holds the state its optimizer started from: the reference's
            assert torch.equal(ref.tensor(f"optimizer_state/{name}"), tgt.tensor(f"optimizer_state/{name}"))
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    verdict = result.verdict()
    assert (result.exit_code, verdict["status"], verdict["num_not_judged"], verdict["warnings"]) == (0, "match", 0, [])
    updates = [r for r in result.rows if r.phase == "optimizer"]
    assert [r.status for r in updates] == ["match"] * 4 and all(r.metrics.max_abs == 0 for r in updates)
    local = [r for r in result.local if r.phase == "optimizer"]
    assert len(local) == 4 and all(r.rel_l2 == 0 for r in local)  # the shadow step, from the loaded state: exact


def test_a_wrong_momentum_kernel_after_the_first_step_is_named(tmp_path, monkeypatch):
    """A target whose optimizer mishandles its momentum (a vendor's SGD) is judged at a later step too: the update
    rows are flagged (not `not_judged`), because both shadow steps start from the recorded momentum."""
    _record(tmp_path / "ref.h5", warm=2, seed=0)
    original = torch.optim.SGD.step

    def wrong(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buf.mul_(1.01)  # the momentum is off by 1 %
        return original(self, closure)

    monkeypatch.setattr(torch.optim.SGD, "step", wrong)
    _record(tmp_path / "tgt.h5", warm=0, seed=5, replay=tmp_path / "ref.h5")
    verdict = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5").verdict()
    assert (verdict["status"], verdict["basis"], verdict["phase"]) == ("diverged", "local_error", "optimizer")
    assert verdict["num_not_judged"] == 0


def test_updates_from_a_state_the_reference_does_not_hold_are_not_judged(tmp_path):
    """A reference written before recordings held the optimizer's state (its attribute says `not recorded`, no
    /optimizer_state): the replay's optimizer keeps its own state, and its updates are shown, never judged."""
    import h5py

    _record(tmp_path / "ref.h5", warm=2, seed=0)
    with h5py.File(tmp_path / "ref.h5", "r+") as f:  # as an older oneiter wrote it
        del f["optimizer_state"]
        f.attrs[OPTIMIZER_STATE] = NOT_RECORDED
    said = _record(tmp_path / "tgt.h5", warm=2, seed=5, replay=tmp_path / "ref.h5")
    with IterationFile(tmp_path / "tgt.h5") as f:
        assert f.meta[OPTIMIZER_STATE] == NOT_RECORDED and "optimizer_state" not in f.file
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    verdict = result.verdict()
    assert (result.exit_code, verdict["status"], verdict["num_not_judged"]) == (0, "match", 4)
    assert [r.status for r in result.rows if r.phase == "optimizer"] == ["not_judged"] * 4
    assert all(r.metrics.max_abs == 0 for r in result.rows if r.phase != "optimizer")  # every gradient is the same
    assert len(verdict["warnings"]) == 1 and verdict["warnings"][0].startswith("updates not judged: the ")
    assert said == verdict["warnings"]  # the recorder warned the same words when it recorded
    assert "updates not judged (why: below)" in verdict["headline"]
    assert not any(u["module"] == "(optimizer)" for u in verdict["unprobed"])


def test_the_first_step_of_a_stateful_optimizer_is_judged(tmp_path):
    _record(tmp_path / "ref.h5", warm=0, seed=0)
    assert _record(tmp_path / "tgt.h5", warm=0, seed=5, replay=tmp_path / "ref.h5") == []
    with IterationFile(tmp_path / "ref.h5") as f:
        assert f.meta[OPTIMIZER_STATE] == EMPTY and "optimizer_state" not in f.file
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert (result.exit_code, result.verdict()["num_not_judged"], result.verdict()["warnings"]) == (0, 0, [])
    assert {r.status for r in result.rows if r.phase == "optimizer"} == {"match"}
    assert {r.phase for r in result.local} >= {"optimizer"}  # the shadow step judged each update


class SGD(torch.optim.SGD):
    """SGD whose load drops the state of its last parameter (a vendor's state-dict hook gone wrong; named SGD, as a
    vendor's drop-in is)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.state.pop(self.param_groups[-1]["params"][-1], None)


def test_a_replay_that_loaded_another_state_or_less_of_it_is_refused(tmp_path):
    """The loaded state is checked against the reference's, value by value: one changed (a load that transforms
    it) or one missing (a load that drops it) is a bad replay, in one line — never a judged update."""
    import shutil

    import h5py

    from oneiter.errors import FormatError

    _record(tmp_path / "ref.h5", warm=2, seed=0)
    _record(tmp_path / "tgt.h5", warm=0, seed=5, replay=tmp_path / "ref.h5")
    _record(tmp_path / "dropped.h5", warm=0, seed=5, replay=tmp_path / "ref.h5", optimizer=SGD)
    changed = tmp_path / "changed.h5"
    shutil.copy(tmp_path / "tgt.h5", changed)
    with h5py.File(changed, "r+") as f:
        f["optimizer_state/0.weight.momentum_buffer"][0, 0] *= 2
    with pytest.raises(FormatError, match=r"bad replay: the target's optimizer_state/0.weight.momentum_buffer differs"):
        oneiter.compare(tmp_path / "ref.h5", changed)
    with pytest.raises(FormatError, match=r"bad replay: the target's optimizer holds no '2.bias.momentum_buffer' "
                                          r"after loading the reference's state \(1 of 4 values missing\)"):
        oneiter.compare(tmp_path / "ref.h5", tmp_path / "dropped.h5")
