"""FSDP2 (`fully_shard`, DTensor parameters) under torchrun, 2 ranks on the CPU with gloo: a model that shards itself
in its builder is recorded (each rank its shard of every parameter, gradient and updated parameter, with where it
sits) and replayed rank by rank, through the CLI's path and through `oneiter.Recorder` in a hand-written loop.

Every recording is made by one torchrun launch (`fsdp2_run.py`, ~10 s on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.ranks import compare_ranks

pytestmark = [pytest.mark.slow,  # torchrun: two processes
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from test_multirank import _free_port

    folder = tmp_path_factory.mktemp("fsdp2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(Path(__file__).with_name("fsdp2_run.py")), str(folder)]
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


def _verdicts(ranked) -> list[tuple]:
    return [(r, v["status"], v["module"], v["phase"]) for r, v in
            ((rank, result.verdict()) for rank, result in sorted(ranked.results.items()))]


def test_each_rank_records_its_shards_with_their_placement(runs):
    with IterationFile(runs / "ref.rank0.h5") as r0, IterationFile(runs / "ref.rank1.h5") as r1:
        assert r0.meta["grad_reduction"] == "reduce_scatter_mean" and r0.meta["world_size"] == 2
        assert r0.meta["model"].endswith("sharded.py:build") and r0.meta["num_calls"] == 13
        for group in ("state_before", "param_grads", "state_after"):
            halves = []
            for rank, f in enumerate((r0, r1)):
                path = f.state(group)["blocks.0.up.weight"]
                attrs = dict(f.file[path].attrs)
                assert f.shape_of(path) == (16, 16), group  # this rank's half of a 32x16 weight
                assert attrs["placements"] == "Shard(dim=0)" and list(attrs["global_shape"]) == [32, 16]
                assert list(attrs["global_offset"]) == [16 * rank, 0]
                halves.append(f.read(path))
            assert not np.array_equal(*halves)  # each rank's own shard
        assert r0.meta["loss"] != r1.meta["loss"]  # each rank's own batch
        # FSDP2's own collectives, recorded on every rank: the parameters' all-gathers, the gradients' reduce-scatters
        for f in (r0, r1):
            found = {(a["op"], a["phase"], a["via"], a["call"]) for _, a in f.collectives()}
            assert {("all_gather", "forward", "torch.distributed.fsdp", ""),
                    ("reduce_scatter", "backward", "torch.distributed.fsdp", "")} <= found


def test_a_model_that_shards_itself_replays_and_a_fault_on_rank_1_is_named_there(runs):
    clean = compare_ranks(runs / "ref.h5", runs / "clean.h5")  # the replay checkpoints every block, too
    assert clean.status == "match"
    assert clean.collectives and not any(j.flagged(clean.factor) for j in clean.collectives)
    assert {j.op for j in clean.collectives} >= {"all_gather", "reduce_scatter"}
    for result in clean.results.values():
        assert all(row.metrics.max_abs == 0 for row in result.rows)
        assert result.verdict()["unprobed"] == [] and result.verdict()["num_local"] > 30
        # how the gradients were reduced, in every report's meta (JSON `meta`)
        assert (result.meta_target["world_size"], result.meta_target["grad_reduction"]) == (2, "reduce_scatter_mean")
    fault = compare_ranks(runs / "ref.h5", runs / "fault.h5")
    assert (fault.status, fault.origin) == ("diverged", 1)
    assert _verdicts(fault) == [(0, "match", None, None), (1, "diverged", "blocks.1.up", "forward")]
    # its noise was calibrated in float64 on the all-gathered weights the call ran with (not on the file's shard)
    assert {r.calibration for r in fault.results[1].local if r.module == "blocks.1.up" and r.phase == "forward"} == {
        "cpu"}


def test_a_hand_written_loop_under_fsdp2_records_and_replays(runs):
    assert compare_ranks(runs / "loop_ref.h5", runs / "loop_clean.h5").status == "match"
    fault = compare_ranks(runs / "loop_ref.h5", runs / "loop_fault.h5")
    assert _verdicts(fault) == [(0, "match", None, None), (1, "diverged", "blocks.0.down", "backward")]
    with IterationFile(runs / "loop_ref.rank1.h5") as f:
        assert f.meta["model"] == "Sharded" and f.meta["optimizer"] == "adamw"
