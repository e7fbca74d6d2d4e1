"""Multi-rank runs: `torchrun --nproc-per-node 2 -m oneiter record` (gloo, DDP on the CPU) writes one file per rank,
and `oneiter compare` judges them rank by rank, naming the rank a fault was injected on.

Three two-rank recordings are made once for the module (a reference, a replay with a forward fault on rank 1 only,
a clean replay): ~40 s on 2 cores. The unit tests at the top need no torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from conftest import FAULT_LAYER, run_cli

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.ranks import find_rank_files
from oneiter.record.modes.faults import Fault, parse_fault
from oneiter.runtime.distributed import RankInfo, rank_info, rank_path

FAULT = FAULT_LAYER["resnet18"]
SMALL = ["--model", "resnet18", "--model-arg", "image_size=32", "--model-arg", "num_classes=10", "--batch-size", "2"]
needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")

pytestmark = pytest.mark.slow  # torchrun: several processes per test


# -- no torchrun ----------------------------------------------------------------------------------------------------
def test_rank_info_reads_torchrun_env_and_names_rank_files():
    assert rank_info({}) == RankInfo(0, 1, 0) and not rank_info({}).distributed
    assert rank_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == RankInfo(1, 2, 1)
    with pytest.raises(OneIterError, match="RANK < WORLD_SIZE"):
        rank_info({"RANK": "2", "WORLD_SIZE": "2"})
    assert rank_path(Path("d/run.h5"), 1, 2) == Path("d/run.rank1.h5")
    assert rank_path(Path("d/run.h5"), 0, 1) == Path("d/run.h5")


def test_fault_rank_selector():
    assert parse_fault("layer1.0.conv1:backward=0.1,rank=1") == Fault("layer1.0.conv1", "backward", 0.1, 1)
    assert parse_fault("conv1,rank=0").applies_to(0) and not parse_fault("conv1,rank=0").applies_to(1)
    assert parse_fault("conv1").rank is None and parse_fault("conv1").applies_to(3)
    for bad in ("conv1,", "conv1,rank=x", "conv1,1", ",rank=1"):
        with pytest.raises(OneIterError):
            parse_fault(bad)
    # `@` means a call index everywhere else: the old rank syntax is refused with the new one in the message
    with pytest.raises(OneIterError, match=r"write a fault's rank as ',rank=R' \(e.g. conv1,rank=1\)"):
        parse_fault("conv1@1")


def test_fault_on_a_rank_the_run_does_not_have_exits_2(tmp_path):
    res = run_cli("record", *SMALL, "--inject-fault", f"{FAULT},rank=1", "-o", tmp_path / "x.h5")
    assert res.exit_code == 2 and "expected a rank below 1" in res.stderr
    assert not (tmp_path / "x.h5").exists()


# -- two ranks under torchrun ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_record(*args) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "oneiter", "record", *map(str, args)]
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[rank 0] recorded" in proc.stderr and "[rank 1] recorded" in proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """ref.rank{0,1}.h5, tgt.rank{0,1}.h5 (forward fault on rank 1 only), clean.rank{0,1}.h5."""
    folder = tmp_path_factory.mktemp("multirank")
    torchrun_record(*SMALL, "-o", folder / "ref.h5")
    torchrun_record("--replay", folder / "ref.h5", "--inject-fault", f"{FAULT},rank=1", "-o", folder / "tgt.h5")
    torchrun_record("--replay", folder / "ref.h5", "-o", folder / "clean.h5")
    return folder


@needs_gloo
def test_each_rank_writes_its_own_batch_and_the_averaged_gradients(runs):
    assert not (runs / "ref.h5").exists()
    assert find_rank_files(runs / "ref.h5") == {0: runs / "ref.rank0.h5", 1: runs / "ref.rank1.h5"}
    with IterationFile(runs / "ref.rank0.h5") as r0, IterationFile(runs / "ref.rank1.h5") as r1:
        assert (r0.meta["rank"], r1.meta["rank"], r0.meta["world_size"]) == (0, 1, 2)
        assert (r0.meta["seed"], r1.meta["seed"]) == (0, 1)  # rank R builds its batch with seed + R
        # module paths are the user's, not DDP's `module.` ones
        assert [key for key, _ in r0.calls()][:2] == ["(root)@0", "conv1@0"]
        assert not np.array_equal(r0.read(r0.batch_paths()[0]), r1.read(r1.batch_paths()[0]))
        assert r0.meta["loss"] != r1.meta["loss"]
        # DDP broadcast rank 0's weights at wrap time, and averaged the gradients in backward
        for group in ("state_before", "param_grads"):
            s0, s1 = r0.state(group), r1.state(group)
            assert set(s0) == set(s1) and len(s0) > 0
            for name in s0:
                assert np.array_equal(r0.read(s0[name]), r1.read(s1[name])), f"{group} {name}"
        # each rank's own gradients before the reduction, whose mean the reduced ones are; DDP's buckets recorded
        assert r0.meta["grad_reduction"] == "allreduce_mean"
        own0, own1, mean = r0.state("param_grads_unreduced"), r1.state("param_grads_unreduced"), r0.state("param_grads")
        assert set(own0) == set(mean) and not np.array_equal(r0.read(own0["fc.weight"]), r1.read(own1["fc.weight"]))
        for name in mean:
            np.testing.assert_allclose(r0.read(mean[name]), (r0.read(own0[name]) + r1.read(own1[name])) / 2,
                                       rtol=1e-5, atol=1e-7)
        buckets = [a for _, a in r0.collectives() if a["bucket"] >= 0]
        assert buckets and all((a["op"], a["phase"], a["call"], a["site"]) == ("all_reduce", "backward", "",
                                                                            f"DDP bucket {a['bucket']}")
                               for a in buckets)
    with IterationFile(runs / "tgt.rank0.h5") as t0, IterationFile(runs / "tgt.rank1.h5") as t1:
        assert json.loads(t0.meta["faults"]) == [] and json.loads(t1.meta["faults"]) == [f"{FAULT},rank=1"]
        assert t1.meta["replay_of"].endswith("ref.rank1.h5")


@needs_gloo
def test_fault_on_one_rank_is_named_with_its_rank(runs):
    res = run_cli("compare", runs / "ref.h5", runs / "tgt.h5", "--json", "-")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    verdict = data["verdict"]
    assert verdict["status"] == "diverged" and verdict["rank"] == 1 and verdict["diverged_ranks"] == [1]
    assert (verdict["module"], verdict["phase"]) == (FAULT, "forward")
    assert [(r["rank"], r["verdict"]["status"]) for r in data["ranks"]] == [(0, "match"), (1, "diverged")]
    assert data["ranks"][1]["target"].endswith("tgt.rank1.h5")
    lines = res.stderr.splitlines()  # with `--json -` the human report goes to stderr
    assert lines[0].startswith(f"DIVERGED on rank 1 at {FAULT}@0 forward output")
    assert lines[1].startswith("rank 0") and "MATCH" in lines[1]
    assert lines[2].startswith("rank 1") and "DIVERGED" in lines[2] and FAULT in lines[2]


@needs_gloo
def test_clean_replay_matches_on_every_rank(runs):
    res = run_cli("compare", runs / "ref.h5", runs / "clean.h5")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == "MATCH on all 2 ranks"
    assert any(line.startswith("collectives: ") and line.endswith(", 0 beyond their noise") for line in lines)
    with IterationFile(runs / "clean.rank1.h5") as f:  # each rank's own backward judged, parameter by parameter
        rows = [r for r in f.local_rows() if r.phase == "param_grad"]
        assert len(rows) == len(f.state("param_grads")) and all(r.rel_l2 == 0 for r in rows)
    assert lines[1].startswith("rank 0") and lines[2].startswith("rank 1") and "MATCH" in lines[2]


@needs_gloo
def test_directories_with_a_missing_rank_exit_2(runs, tmp_path):
    ref_dir, tgt_dir = tmp_path / "ref", tmp_path / "tgt"
    ref_dir.mkdir(), tgt_dir.mkdir()
    for rank in (0, 1):
        os.link(runs / f"ref.rank{rank}.h5", ref_dir / f"ref.rank{rank}.h5")
    os.link(runs / "tgt.rank0.h5", tgt_dir / "tgt.rank0.h5")
    res = run_cli("compare", ref_dir, tgt_dir)
    assert res.exit_code == 2 and "rank 1 of 2 is missing" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    os.link(runs / "clean.rank0.h5", tgt_dir / "clean.rank0.h5")  # two runs in one directory
    res = run_cli("compare", ref_dir, tgt_dir)
    assert res.exit_code == 2 and "rank files of 2 runs" in res.stderr


@needs_gloo
def test_a_process_group_left_alive_is_destroyed_at_exit_before_python_finalizes(tmp_path):
    """`destroy_at_exit` (what the Hugging Face callback asks for under torchrun: the Trainer never destroys its
    group, and gloo may abort the process as Python finalizes): an exit handler registered before it, so run after
    it, sees the group gone; registered twice, it runs once."""
    script = tmp_path / "leaves_its_group.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "from oneiter.runtime.distributed import destroy_at_exit\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{_free_port()}', rank=0, world_size=1)\n"
        "destroy_at_exit(); destroy_at_exit()\n"
        "print('initialized:', dist.is_initialized(), flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["initialized: True", "initialized at exit: False"]
