"""Collectives recorded and forced, in this process on a one-rank gloo group (the multi-rank runs are
tests/runtime/test_parallel.py): a collective a call's own code runs is stored with its owner, phase and site, and a
replay's reruns are answered from the reference's record, never run again; a rerun that runs a collective the call
did not is unprobed with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oneiter
from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.engine import compare_files

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Sum(torch.autograd.Function):
    """All-reduce forward, all-reduce of the gradient backward (Megatron's two mappings in one)."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class Row(nn.Module):
    def __init__(self, odd: bool = False):
        super().__init__()
        self.lin, self.odd, self.calls = nn.Linear(8, 8), odd, 0

    def forward(self, x):
        self.calls += 1
        y = _Sum.apply(self.lin(x))
        if self.odd and self.calls > 1:  # a rerun of this call runs one more collective than the live call did
            dist.broadcast(y, 0)
        return y


def _record(out, replay=None, odd=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Row(odd), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    with oneiter.Recorder(model, out, optimizer=opt, replay=replay) as rec:
        x, y = rec.inputs(x, y)
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_collectives_are_recorded_with_their_call_and_forced_in_reruns(one_rank, tmp_path):
    _record(tmp_path / "ref.h5")
    _record(tmp_path / "tgt.h5", replay=tmp_path / "ref.h5")
    with IterationFile(tmp_path / "ref.h5") as f:
        found = [(a["op"], a["phase"], a["call"], a["group_ranks"], a["group_seq"]) for _, a in f.collectives()]
        assert found == [("all_reduce", "forward", "1@0", [0], 0), ("all_reduce", "backward", "1@0", [0], 1)]
        name, attrs = f.collectives()[0]
        assert attrs["site"].startswith("test_collectives_record.py:") and attrs["via"] == ""
        assert f.shape_of(f"collectives/{name}/input.0") == (3, 8)
    with IterationFile(tmp_path / "tgt.h5") as f:
        assert f.unprobed() == [] and {r.module for r in f.local_rows()} >= {"1", "1.lin"}
    result = compare_files(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert result.status == "match" and all(row.metrics.max_abs == 0 for row in result.rows)


def test_a_rerun_that_runs_another_collective_is_unprobed_not_run(one_rank, tmp_path):
    _record(tmp_path / "ref.h5")
    _record(tmp_path / "tgt.h5", replay=tmp_path / "ref.h5", odd=True)
    with IterationFile(tmp_path / "tgt.h5") as f:
        reasons = {m: why for m, _, why in f.unprobed()}
        assert reasons["1"].startswith("the rerun ran a collective (broadcast of [[3, 8]] in forward) the source "
                                       "did not record for this call")
        assert [a["op"] for _, a in f.collectives()] == ["all_reduce", "all_reduce"]  # the live run's only
