"""The optimizer's starting state (`format/optimizer_state.py`): an update is judged only when the replay's optimizer
started where the reference's did; otherwise its rows are `not_judged` and the verdict says why, in one line."""

from __future__ import annotations

import warnings

import pytest
import torch

import oneiter
from oneiter.format.layout import IterationFile
from oneiter.format.optimizer_state import EMPTY, NOT_RECORDED, OPTIMIZER_STATE, state_of, updates_not_judged


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _record(out, *, warm: int, seed: int, replay=None):
    """A momentum-SGD model after `warm` plain steps of its own, then one recorded step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
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
    assert updates_not_judged(EMPTY, NOT_RECORDED, "sgd").startswith("updates not judged: the target's optimizer (sgd)")
    assert updates_not_judged(NOT_RECORDED, EMPTY).startswith("updates not judged: the reference's optimizer")


@pytest.mark.parametrize("warm_ref, warm_tgt", [(2, 2), (2, 0)], ids=["both-stateful", "reference-stateful"])
def test_updates_from_another_starting_state_are_not_judged(tmp_path, warm_ref, warm_tgt):
    assert _record(tmp_path / "ref.h5", warm=warm_ref, seed=0) == []
    said = _record(tmp_path / "tgt.h5", warm=warm_tgt, seed=5, replay=tmp_path / "ref.h5")
    with IterationFile(tmp_path / "tgt.h5") as f:
        assert f.meta[OPTIMIZER_STATE] == (NOT_RECORDED if warm_tgt else EMPTY)
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
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert (result.exit_code, result.verdict()["num_not_judged"], result.verdict()["warnings"]) == (0, 0, [])
    assert {r.status for r in result.rows if r.phase == "optimizer"} == {"match"}
    assert {r.phase for r in result.local} >= {"optimizer"}  # the shadow step judged each update
