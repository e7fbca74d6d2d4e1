"""Two-dimensional meshes: `record --data-parallel` decides DDP per mesh dimension (`oneiter/runtime/meshes.py`), and
on 4 ranks under torchrun (gloo) torchtitan's tensor x FSDP2 layout, tensor parallelism with DDP over the data
dimension, and a pipeline of 2 stages each in DDP over the data dimension replay clean on every rank, a layer fault
named on its rank (`mesh_run.py`, one launch with a timeout). The choice's parsing runs without torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.ranks import compare_ranks
from oneiter.record.run import SpecOptions
from oneiter.runtime.meshes import WORLD, ddp_over, per_dimension

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.mark.parametrize("choice,dims", [("auto", None), ("ddp", None), ("none", None), ("dp=ddp", {"dp": "ddp"}),
                                         ("dp=ddp, tp=none", {"dp": "ddp", "tp": "none"})])
def test_data_parallel_takes_a_choice_or_one_per_mesh_dimension(choice, dims):
    assert per_dimension(choice) == dims


@pytest.mark.parametrize("choice", ["DDP", "dp=fsdp", "dp=ddp,dp=none", "=ddp", "dp:ddp"])
def test_a_data_parallel_choice_of_another_form_is_refused_before_anything_is_built(choice):
    with pytest.raises(OneIterError, match="data_parallel must be one of auto, ddp, none or DIM=ddp|none"):
        SpecOptions(out=Path("x.h5"), model="resnet18", data_parallel=choice)


def test_a_model_without_a_mesh_is_wrapped_over_every_rank_unless_it_splits_itself_by_megatron_marks():
    plain = torch.nn.Linear(2, 2)
    assert (ddp_over("auto", plain), ddp_over("ddp", plain), ddp_over("none", plain)) == (WORLD, WORLD, None)
    plain.weight.tensor_model_parallel = True  # Megatron-LM's mark of a tensor-parallel slice
    assert (ddp_over("auto", plain), ddp_over("ddp", plain)) == (None, WORLD)
    with pytest.raises(OneIterError, match="not DTensors, so it has no device mesh whose dimensions to name"):
        ddp_over("dp=ddp", plain)


# -- 4 ranks --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    from test_multirank import _free_port

    folder = tmp_path_factory.mktemp("meshes")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(Path(__file__).with_name("mesh_run.py")), str(folder)]
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("layout,rank,layer", [("tp_fsdp", 1, "layers.0.feed_forward.w1"),
                                               ("tp_ddp", 1, "layers.0.feed_forward.w1"),
                                               ("pp_ddp", 3, "layers.2.mlp.down_proj")])
def test_a_2d_mesh_replays_clean_on_all_4_ranks_and_a_fault_is_named_on_its_rank(four, layout, rank, layer):
    clean = compare_ranks(four / layout / "ref.h5", four / layout / "clean.h5")
    assert [(r, result.status) for r, result in clean.results.items()] == [(r, "match") for r in range(4)]
    assert clean.collectives and not any(j.flagged(clean.factor) for j in clean.collectives)
    fault = compare_ranks(four / layout / "ref.h5", four / layout / "layer.h5")
    assert (fault.status, fault.origin, list(fault.diverged_ranks)) == ("diverged", rank, [rank])
    verdict = fault.results[rank].verdict()
    assert (verdict["focus"], verdict["module"], verdict["phase"]) == ("culprit", layer, "forward")


@pytest.mark.slow
@needs_gloo
def test_data_parallel_wraps_ddp_over_the_dimension_the_parameters_leave_free(four):
    """tensor x FSDP2: every dimension holds the parameters, nothing wrapped; tensor parallelism alone: DDP over "dp",
    whose buckets are all-reduced over each rank's data-parallel group; the pipeline: its stage's DDP, each rank's
    own gradients not kept (DDP reduces in an earlier microbatch's backward too)."""
    with IterationFile(four / "tp_fsdp" / "ref.rank1.h5") as f:
        assert f.meta["grad_reduction"] == "reduce_scatter_mean"
        assert not any(a["bucket"] >= 0 for _, a in f.collectives())
    with IterationFile(four / "tp_ddp" / "ref.rank1.h5") as f:
        assert f.meta["grad_reduction"] == "allreduce_mean"
        buckets = [list(a["group_ranks"]) for _, a in f.collectives() if a["bucket"] >= 0]
        assert buckets and all(ranks == [1, 3] for ranks in buckets)  # rank 1's data-parallel group
        assert f.names_in("param_grads_unreduced") and f.names_in("param_grads")  # the optimizer stepped them
        assert f.names_in("state_after") == f.names_in("state_before")
    with IterationFile(four / "pp_ddp" / "ref.rank2.h5") as f:
        assert f.meta["microbatches"] == 4 and f.meta["grad_reduction"] == "allreduce_mean"
        assert not f.names_in("param_grads_unreduced")
        assert {int(a["peer"]) for _, a in f.collectives() if a["op"] in ("send", "recv")} == {0}  # stage 0 of dp 0
