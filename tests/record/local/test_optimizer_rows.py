"""The optimizer rows of a replay: the target's optimizer stepped from the reference's weights and gradients, one
chunk of parameters at a time where the optimizer updates each parameter on its own (`step_chunks`)."""

from __future__ import annotations

import pytest
import torch
from conftest import record_small, replay

from oneiter.format.layout import IterationFile
from oneiter.format.schema import PARAM_GRADS, group_path
from oneiter.record.local import optimizer_rows
from oneiter.record.local.rerun import Site


class _Source:
    """What `shadow_step` reads: the reference's weights (state_before) and gradients, by name."""

    def __init__(self, weights: dict, grads: dict):
        self.weights, self.grads = weights, grads

    def reference_state(self, name):
        return self.weights.get(name)

    def step_start(self, name):  # where each step starts: state_before (no parameter written in forward)
        return self.weights.get(name)

    @property
    def source(self):
        return self

    def has(self, path):
        return path in self.grads

    def uncached(self, path):
        return self.grads[path]

    def cached(self, path):
        return False


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    lambda ps: torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-2, "weight_decay": 0.0}], lr=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
], ids=["sgd", "adamw-two-groups", "adam-foreach"])
def test_a_step_in_chunks_is_bitwise_the_step_over_all(make):
    model = _model()
    opt = make(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {group_path(PARAM_GRADS, n): torch.randn_like(p) for n, p in model.named_parameters()}
    source, site = _Source(weights, grads), Site("target", torch.device("cpu"), live=True, cast="live",
                                                 autocast=None, params="reference", trusted=False)
    whole = optimizer_rows.shadow_step(opt, names, source, site)
    # the largest weight alone; the others together
    chunks = optimizer_rows.step_chunks(opt, budget_bytes=300 * 200 * 4)
    assert [len(c) for c in chunks] == [2, 1, 3]  # linear0 weight+bias, linear1 weight, the rest
    assert set().union(*chunks) == set(names) and sum(map(len, chunks)) == len(names)
    parts = {}
    for chunk in chunks:
        parts.update(optimizer_rows.shadow_step(opt, names, source, site, chunk))
    assert parts.keys() == whole.keys() == set(weights)
    for name in whole:
        assert not torch.equal(whole[name], weights[name]), name  # the step changed it
        assert torch.equal(parts[name], whole[name]), name
    assert not any(len(s) for s in opt.state.values())  # the shadow steps leave the real optimizer alone


def test_optimizers_that_may_couple_parameters_step_once_over_all():
    model = _model()
    params = list(model.parameters())

    class Clipped(torch.optim.SGD):  # a subclass may look at every gradient at once
        pass

    assert len(optimizer_rows.step_chunks(torch.optim.SGD(params, lr=0.1))) == 1  # 0.3 MB: one chunk
    assert optimizer_rows.step_chunks(Clipped(params, lr=0.1)) == [None]
    assert optimizer_rows.step_chunks(torch.optim.LBFGS(params)) == [None]


def test_a_replay_judges_every_update_the_same_in_chunks(tmp_path, monkeypatch):
    """A real replay (llama_tiny, AdamW): every parameter gets its optimizer row, equal field by field whether its
    update was stepped one parameter at a time or all at once."""
    ref = tmp_path / "ref.h5"
    record_small(ref, "llama_tiny", optimizer="adamw")
    calls = []
    step = optimizer_rows.shadow_step
    monkeypatch.setattr(optimizer_rows, "shadow_step", lambda *a, **k: calls.append(a[4]) or step(*a, **k))
    monkeypatch.setattr(optimizer_rows, "STEP_BYTES", 1)
    replay(ref, tmp_path / "chunked.h5", optimizer="adamw")
    monkeypatch.setattr(optimizer_rows, "PER_PARAMETER", frozenset())
    replay(ref, tmp_path / "whole.h5", optimizer="adamw")

    def rows(path):
        with IterationFile(path) as f:
            return {(r.module, r.tensor): r for r in f.local_rows() if r.phase == "optimizer"}

    chunked, whole = rows(tmp_path / "chunked.h5"), rows(tmp_path / "whole.h5")
    num_params = sum(1 for c in calls if c is not None)
    assert calls[-1] is None and all(len(c) == 1 for c in calls[:-1])  # one parameter per chunk, then all at once
    assert len(chunked) == num_params == len(whole) > 10
    for key, row in whole.items():
        assert repr(chunked[key]) == repr(row), key  # every field, NaN (noise not measured) included
