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


STAND_IN = """
import sys
import torch, torch.distributed as dist
import faulty_collectives, moe_a2a, tensor_parallel
for build in (tensor_parallel.build, tensor_parallel.build_dtensor, moe_a2a.build):  # one process: the plain model
    model, inputs, loss_fn = build(4, collective_fault="offset", fault_rank=0)
    loss_fn(model(*inputs)).backward()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
faulty_collectives.install("offset", rank=0)  # wrong on its own, with nothing of oneiter around it
x = torch.ones(4)
dist.all_reduce(x)
print(x[0].item(), sorted(n for n in sys.modules if n.split(".")[0] == "oneiter"))
"""


def test_the_faulty_collective_library_and_the_parallel_models_never_import_oneiter():
    import subprocess
    import sys

    from conftest import MODEL_FILES

    env = {"PYTHONPATH": str(MODEL_FILES), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    value, loaded = proc.stdout.split()
    assert float(value) == torch.tensor(1.001).item() and loaded == "[]"  # 0.1 % off; not one oneiter module loaded


def test_a_model_that_parallelises_itself_is_not_wrapped_in_ddp_unless_asked(one_rank, monkeypatch, tmp_path):
    from conftest import MODEL_FILES, run_cli

    from oneiter.errors import OneIterError
    from oneiter.record.run import SpecOptions
    from oneiter.runtime.meshes import WORLD, ddp_over

    monkeypatch.syspath_prepend(str(MODEL_FILES))
    import tensor_parallel

    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    megatron = tensor_parallel.build(4)[0]  # Megatron-LM's `tensor_model_parallel` mark on its sharded weights
    dtensor = tensor_parallel.parallelize(tensor_parallel.TokenMLP())  # torch.distributed.tensor.parallel
    models = (plain, megatron, dtensor)
    assert [ddp_over("auto", m) for m in models] == [WORLD, None, None]  # the mesh's one dimension holds dtensor's
    assert [ddp_over("none", m) for m in models] == [None, None, None]
    assert ddp_over("ddp", plain) == ddp_over("ddp", megatron) == WORLD
    with pytest.raises(OneIterError, match=r"^--data-parallel ddp: every dimension of the model's mesh \(1 unnamed\)"):
        ddp_over("ddp", dtensor)
    wanted = ("data_parallel must be one of auto, ddp, none or DIM=ddp|none per mesh dimension (dp=ddp,tp=none), got "
              "'fsdp'")
    with pytest.raises(OneIterError) as refused:
        SpecOptions(out="x.h5", data_parallel="fsdp")
    assert str(refused.value) == wanted
    res = run_cli("record", "--data-parallel", "fsdp", "-o", tmp_path / "x.h5")
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: --{wanted.replace('_', '-', 1)}"] and not (tmp_path / "x.h5").exists()


FAILING_MODEL = """
import faulty_collectives, torch, torch.distributed as dist, torch.nn as nn

class Summed(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        dist.all_reduce(y)
        return y

def build(batch_size):
    faulty_collectives.install("fail", rank=0)  # the backend raises as gloo does when a peer went away
    model = nn.Sequential(nn.Linear(4, 8), Summed(8, 2))
    return model, (torch.randn(batch_size, 4),), lambda out: out.square().mean()
"""


def test_a_collective_the_backend_cannot_complete_is_one_line_and_exit_2_not_an_internal_error(
        one_rank, monkeypatch, tmp_path):
    from conftest import MODEL_FILES, run_cli

    monkeypatch.syspath_prepend(str(MODEL_FILES))
    import faulty_collectives

    (tmp_path / "failing.py").write_text(FAILING_MODEL)
    try:
        res = run_cli("record", "--model", f"{tmp_path / 'failing.py'}:build", "-o", tmp_path / "x.h5")
    finally:
        faulty_collectives.uninstall()
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        "error: all_reduce on ranks [0] at failing.py:7 in forward failed on this rank: RuntimeError: "
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:14240 (when another rank stopped "
        "first, its error says why)"]
    assert not (tmp_path / "x.h5").exists()
