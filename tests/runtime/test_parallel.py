"""Models that span ranks, under torchrun on gloo with 2 and 4 ranks: a hand-written (Megatron-style) tensor-parallel
MLP, the same kind of model parallelised with `torch.distributed.tensor.parallel`, and a 2-expert MoE layer whose
tokens are dispatched and combined with all-to-all (`tests/model_files/tensor_parallel.py`, `moe_a2a.py`). Clean
replays match on every rank; a collective library that is wrong (`faulty_collectives.py`: 0.1 % off on rank 1,
accumulating in bfloat16, or dropping the last rank's contribution: a model argument, never oneiter) is named as
that collective; a layer fault on rank 1 is named as that layer on rank 1; nothing hangs (every launch has a
timeout). Multi-step recordings run under torchrun, one file per rank, and compare names the first step per rank.
`torchrun -m oneiter compare` over 32 rank-file pairs with 4 processes gives the verdict one process gives (256:
bench/bench_compare_ranks.py).

Every recording of a world size comes from one torchrun launch (`parallel_run.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from conftest import run_cli
from rank_files import make_ranks

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.ranks import compare_ranks

pytestmark = [pytest.mark.slow,  # torchrun: several processes
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

LAYERS = {"megatron": "blocks.0.fc1", "dtensor": "layers.0.feed_forward.w1", "moe": "moe.experts.0.up"}


def _torchrun(nproc: int, *args, timeout: int = 900) -> subprocess.CompletedProcess:
    from test_multirank import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), *map(str, args)]
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _launch(folder: Path, world: int, *extra: str) -> Path:
    proc = _torchrun(world, Path(__file__).with_name("parallel_run.py"), folder, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("parallel2"), 2, "steps")


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("parallel4"), 4)


def _statuses(ranked) -> list[tuple[int, str]]:
    return [(rank, result.status) for rank, result in ranked.results.items()]


def _check_models(folder: Path, world: int) -> None:
    for name, layer in LAYERS.items():
        clean = compare_ranks(folder / name / "ref.h5", folder / name / "clean.h5")
        assert _statuses(clean) == [(r, "match") for r in range(world)], name
        assert clean.collectives and not any(j.flagged(clean.factor) for j in clean.collectives), name
        for result in clean.results.values():  # judged call by call, nothing of it left out
            assert result.verdict()["num_local"] > 10 and all(r.metrics.max_abs == 0 for r in result.rows)
        fault = compare_ranks(folder / name / "ref.h5", folder / name / "layer.h5")
        assert (fault.status, fault.origin) == ("diverged", 1), name
        verdict = fault.results[1].verdict()
        assert (verdict["focus"], verdict["module"], verdict["phase"]) == ("culprit", layer, "forward"), name
        assert not any(j.flagged(fault.factor) for j in fault.collectives), name  # right, on wrong inputs
        others = [s for r, s in _statuses(fault) if r != 1]
        assert others == ["match"] * (world - 1), (name, _statuses(fault))


def _collective(folder: Path, name: str, fault: str) -> dict:
    ranked = compare_ranks(folder / name / "ref.h5", folder / name / f"{fault}.h5")
    assert ranked.status == "diverged"
    verdict = ranked.verdict()
    assert verdict["focus"] == "collective", verdict["headline"]
    assert verdict["headline"].startswith(f"DIVERGED on rank {ranked.origin} at collective ")
    assert all(result.culprit is None for result in ranked.results.values())  # no layer is blamed for it
    return {**verdict["collective"], "rank": ranked.origin, "ranks": ranked.diverged_ranks}


def test_two_ranks_clean_replays_match_and_a_layer_fault_is_named_on_its_rank(two):
    _check_models(two, 2)
    with IterationFile(two / "megatron" / "ref.rank1.h5") as f:
        found = [(a["op"], a["phase"], a["call"]) for _, a in f.collectives()]
        # the forward all-reduce of each row-parallel fc2, the backward one of each column-parallel fc1
        assert found == [("all_reduce", "forward", "blocks.0.fc2@0"), ("all_reduce", "forward", "blocks.1.fc2@0"),
                         ("all_reduce", "backward", "blocks.1.fc1@0"), ("all_reduce", "backward", "blocks.0.fc1@0")]
        assert f.meta["grad_reduction"] == "none"  # not wrapped in DDP: each rank's own gradients
    # each rank its own shard; --data-parallel ddp wraps the model all the same: DDP makes every rank's shards rank
    # 0's, and averages the gradients
    for name, shared in (("ref", False), ("ddp", True)):
        with IterationFile(two / "megatron" / f"{name}.rank0.h5") as r0, \
                IterationFile(two / "megatron" / f"{name}.rank1.h5") as r1:
            shards = [f.read(f.state("state_before")["blocks.0.fc1.weight"]) for f in (r0, r1)]
            assert np.array_equal(*shards) == shared, name
            assert r1.meta["grad_reduction"] == ("allreduce_mean" if shared else "none"), name
            assert any(a["bucket"] >= 0 for _, a in r1.collectives()) == shared, name
    res = run_cli("compare", two / "megatron" / "ref.h5", two / "megatron" / "clean.h5")
    assert res.exit_code == 0 and res.stdout.splitlines()[0] == "MATCH on all 2 ranks", res.output


def test_two_ranks_a_wrong_collective_library_is_named_as_the_collective(two):
    res = run_cli("compare", two / "megatron" / "ref.h5", two / "megatron" / "offset.h5")
    assert res.exit_code == 1 and res.stdout.startswith("DIVERGED on rank 1 at collective all_reduce sum #0 (group"), \
        res.output
    offset = _collective(two, "megatron", "offset")  # 0.1 % off on rank 1 only
    assert (offset["rank"], offset["ranks"], offset["op"], offset["index"]) == (1, [1], "all_reduce", 0)
    assert offset["call"] == "blocks.0.fc2@0" and offset["site"].startswith("tensor_parallel.py:")
    assert 5e3 < offset["ratio"] < 5e5 and offset["rel_l2"] == pytest.approx(1e-3, rel=0.05)
    bf16 = _collective(two, "megatron", "bf16")  # every rank sums in bfloat16: the first rank is named
    assert (bf16["rank"], bf16["index"], bf16["op"]) == (0, 0, "all_reduce") and bf16["ratio"] > 100
    drop = _collective(two, "megatron", "drop")
    assert (drop["rank"], drop["index"], drop["ranks"]) == (0, 0, [0, 1]) and drop["rel_l2"] > 0.1
    dtensor = _collective(two, "dtensor", "offset")  # DTensor's reduce-scatter into the sequence shards
    assert (dtensor["rank"], dtensor["op"], dtensor["call"]) == (1, "reduce_scatter", "tok_embeddings@0")
    assert dtensor["via"] == "torch.distributed.tensor"
    moe = _collective(two, "moe", "offset")  # the dispatch: no arithmetic, so bitwise
    assert (moe["rank"], moe["op"], moe["call"], moe["expected"]) == (1, "all_to_all", "moe@0", 0.0)
    # statistics only: the output's sum against the inputs'; without local data rank 0 diverges later, downstream
    stats = _collective(two, "megatron", "stats_offset")
    assert (stats["rank"], stats["index"], stats["level"], stats["ranks"]) == (1, 0, "statistics", [0, 1])


def test_four_ranks(four):
    _check_models(four, 4)
    drop = _collective(four, "megatron", "drop")  # the last rank's contribution lost on every rank
    assert (drop["rank"], drop["index"], drop["ranks"]) == (0, 0, [0, 1, 2, 3])
    bf16 = _collective(four, "dtensor", "bf16")
    assert bf16["rank"] == 0 and bf16["op"] == "reduce_scatter" and bf16["ratio"] > 100
    moe = _collective(four, "moe", "offset")  # expert-parallel groups {0, 1} and {2, 3}: rank 1's is wrong
    assert (moe["rank"], moe["ranks"], moe["group_ranks"]) == (1, [1], [0, 1])


def test_several_steps_under_torchrun_one_file_per_rank_and_the_first_step_per_rank(two):
    assert sorted(p.name for p in two.glob("steps_*.h5")) == [
        "steps_fault.rank0.h5", "steps_fault.rank1.h5", "steps_ref.rank0.h5", "steps_ref.rank1.h5"]
    with IterationFile(two / "steps_ref.rank1.h5") as f:
        assert f.steps() == [0, 1, 2] and (f.meta["rank"], f.meta["world_size"]) == (1, 2)
    res = run_cli("compare", two / "steps_ref.h5", two / "steps_fault.h5", "--json", "-")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    # rank 1's inp is wrong from step 2; its all-reduces carry it to rank 0 in the same step
    assert [(r["rank"], r["verdict"]["status"], r["verdict"]["step"]) for r in data["ranks"]] == [
        (0, "diverged", 2), (1, "diverged", 2)]
    assert res.stderr.splitlines()[0].startswith("DIVERGED on rank 0 at step 2 (2 of 2 ranks diverged")


def test_compare_under_torchrun_over_many_rank_files_gives_the_one_process_verdict(tmp_path):
    # 32 pairs here (each launch costs seconds); bench/bench_compare_ranks.py runs 256 with 1, 2 and 4 processes
    ref, tgt = make_ranks(tmp_path, 32, diverged=(9, 21))
    one = run_cli("compare", ref, tgt, "--json", str(tmp_path / "one.json"))
    assert one.exit_code == 1, one.output
    proc = _torchrun(4, "-m", "oneiter", "compare", ref, tgt, "--json", tmp_path / "four.json", timeout=600)
    # every process exits with the verdict's code (1); torchrun reports that as a failure and exits 1 itself
    assert proc.returncode == 1 and "DIVERGED on rank 9" in proc.stdout, proc.stderr[-3000:]
    assert proc.stdout.count("DIVERGED on rank 9") == 1 and "(exitcode: 1)" in proc.stderr  # process 0 reports
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "four"))
    assert a["verdict"] == b["verdict"] and a["ranks"] == b["ranks"] and len(a["ranks"]) == 32
    assert a["verdict"]["rank"] == 9 and a["verdict"]["diverged_ranks"] == [9, 21]
    assert np.array_equal([r["rank"] for r in b["ranks"]], np.arange(32))
    # files that cannot be compared so: a process stops with the one-line error and exit 2, nothing hangs. torchrun
    # stops the other process once one failed, so on a loaded machine the other may be stopped before its own line
    # (one of two lines in a .ci/run beside a zoo sweep): at least one line, never a traceback
    bad = _torchrun(2, "-m", "oneiter", "compare", ref / "run.rank0.h5", tgt / "run.rank0.h5", timeout=300)
    assert bad.returncode == 1 and "(exitcode: 2)" in bad.stderr and "Traceback" not in bad.stdout
    assert 1 <= bad.stderr.count("error: compare under torchrun shares the files of multi-rank runs") <= 2
