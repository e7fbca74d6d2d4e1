"""Pipeline-parallel training recorded on 2 ranks under torchrun (gloo), through `oneiter.Recorder` around the
training step: `torch.distributed.pipelining`'s GPipe, 1F1B and interleaved 1F1B (2 stages per rank) with 4
microbatches, and a Megatron-style 1F1B written by hand with `send`/`recv` and with `batch_isend_irecv`, over the
tiny Hugging Face Llama split into stages (`tests/model_files/pipelines.py`); and a model whose layer exchanges
activations with `isend`/`irecv` inside its own forward and backward (`ring_exchange.py`), whose reruns must not
communicate. Clean replays from other weights match on both ranks; a layer fault on rank 1 is named there with its
microbatch; a point-to-point library that corrupts one send (`faulty_p2p.py`, pure torch) is named as that transfer,
never as the layer that consumed it. Nothing hangs: an error on one rank mid-schedule, a peer that never sends and a
schedule a recording cannot hold each end every rank within 60 s, with one line; oneiter's own collectives (what
`compare` under torchrun gathers) end a process in one line when another is late past their timeout. Every launch
has a timeout.

All recordings come from one torchrun launch (`pipeline_run.py`); each failure from a launch of its own
(`pipeline_failures.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.ranks import compare_ranks

pytestmark = [pytest.mark.slow,  # torchrun: several processes
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

HERE = Path(__file__).parent
LAYER = {"interleaved": "1.layers.1.mlp.down_proj"}  # the layer pipeline_run.py breaks on rank 1


def _launch(script: str, *args, timeout: int, **env) -> tuple[subprocess.CompletedProcess, float]:
    from test_multirank import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / script), *map(str, args)]
    started = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pipelines")
    proc, _ = _launch("pipeline_run.py", folder, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


def _statuses(ranked) -> list[tuple[int, str]]:
    return [(rank, result.status) for rank, result in ranked.results.items()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "megatron", "megatron_async"])
def test_a_pipeline_step_replays_clean_on_both_ranks_and_a_stage_1_fault_is_named_with_its_microbatch(runs, schedule):
    folder = runs / schedule
    with IterationFile(folder / "ref.rank0.h5") as first, IterationFile(folder / "ref.rank1.h5") as last:
        assert first.meta["microbatches"] == last.meta["microbatches"] == 4
        stage_calls = [attrs.get("microbatch", 0) for _, attrs in first.calls() if not attrs["parent"]]
        per_stage = [0, 1, 2, 3] * (2 if schedule == "interleaved" else 1)
        # one call per microbatch and stage, numbered by microbatch, the schedule's shape inference not among them
        assert sorted(stage_calls) == sorted(per_stage)
        ops = [(a["op"], a["phase"]) for _, a in first.collectives() if a["op"] in ("send", "recv")]
        # every microbatch's activations sent forward and its gradient received back (and, for
        # torch.distributed.pipelining, the schedule's own set-up exchange)
        assert ops.count(("send", "forward")) >= 4 * (2 if schedule == "interleaved" else 1)
        assert ops.count(("recv", "backward")) == 4 * (2 if schedule == "interleaved" else 1)
        assert last.read("microbatch_loss").shape == (4,)  # the last stage's losses
    clean = compare_ranks(folder / "ref.h5", folder / "clean.h5")
    assert _statuses(clean) == [(0, "match"), (1, "match")]
    assert not any(j.flagged(clean.factor) for j in clean.collectives)
    for result in clean.results.values():
        assert result.verdict()["num_local"] > 100 and all(r.metrics.max_abs == 0 for r in result.rows)
    fault = compare_ranks(folder / "ref.h5", folder / "layer.h5")
    assert (fault.status, fault.origin, _statuses(fault)) == ("diverged", 1, [(0, "match"), (1, "diverged")])
    verdict = fault.results[1].verdict()
    culprit = verdict["culprit"]
    assert (verdict["focus"], verdict["module"], verdict["phase"]) == ("culprit", LAYER.get(schedule,
                                                                     "layers.2.mlp.down_proj"), "forward")
    assert culprit["microbatch"] == 0  # every microbatch is wrong: the first is named


@pytest.mark.parametrize("schedule,site", [("1f1b", "pipeline_run.py"), ("megatron", "pipelines.py"),
                                           ("ring", "ring_exchange.py")])
def test_a_corrupted_send_is_named_as_that_transfer_on_the_receiving_rank(runs, schedule, site):
    ranked = compare_ranks(runs / schedule / "ref.h5", runs / schedule / "p2p.h5")
    assert (ranked.status, ranked.origin) == ("diverged", 1)
    verdict = ranked.verdict()
    assert verdict["focus"] == "collective" and verdict["headline"].startswith("DIVERGED on rank 1 at transfer recv "
                                                                               "from rank 0 #")
    flagged = [j for j in ranked.collectives if j.flagged(ranked.factor)]
    assert [(j.rank, j.op, j.peer, j.kind) for j in flagged] == [(1, "recv", 0, "transfer")]
    transfer = flagged[0]
    assert transfer.rel_l2 == pytest.approx(1e-3, rel=0.05) and transfer.site.startswith(site)
    assert transfer.phase == "forward"
    if schedule == "ring":  # a layer's own exchange: its call, one microbatch
        assert (transfer.call, transfer.microbatch) == ("blocks.0.mix@0", -1)
    else:  # rank 0's third floating-point send: microbatch 2's activations
        assert transfer.microbatch == 2 and transfer.call == ""
    assert all(result.culprit is None for result in ranked.results.values())  # no layer is blamed for it


def test_reruns_of_a_layer_that_exchanges_point_to_point_get_the_recorded_values(runs):
    ranked = compare_ranks(runs / "ring" / "ref.h5", runs / "ring" / "clean.h5")
    assert ranked.status == "match"
    for result in ranked.results.values():
        judged = {(r.module, r.phase) for r in result.local}
        assert ("blocks.0.mix", "forward") in judged and ("blocks.1.mix", "backward") in judged
        assert not any(entry["module"].endswith("mix") for entry in result.unprobed)
    with IterationFile(runs / "ring" / "ref.rank1.h5") as f:
        owned = [(a["op"], a["call"], a["phase"]) for _, a in f.collectives()]
    assert ("recv", "blocks.0.mix@0", "forward") in owned and ("recv", "blocks.1.mix@0", "backward") in owned


def _one_line_errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "OneIterError:" in line]


def test_an_error_on_one_rank_mid_schedule_ends_both_within_60_seconds(tmp_path):
    proc, took = _launch("pipeline_failures.py", tmp_path, "error", timeout=120)
    assert proc.returncode != 0 and took < 60, (took, proc.stderr[-2000:])
    assert "ValueError: the loss function failed on microbatch 2" in proc.stderr
    assert not list(tmp_path.glob("*.h5"))


def test_a_peer_that_never_sends_ends_the_receiver_within_oneiters_timeout(tmp_path):
    proc, took = _launch("pipeline_failures.py", tmp_path, "stall", timeout=120, ONEITER_DIST_TIMEOUT="3")
    assert proc.returncode != 0 and took < 60, (took, proc.stderr[-2000:])
    lines = _one_line_errors(proc)
    assert lines and "recv from rank 1 at pipeline_failures.py:" in lines[0] and "Timed out" in lines[0], lines


def test_a_zero_bubble_schedule_is_refused_on_every_rank_before_it_communicates(tmp_path):
    proc, took = _launch("pipeline_failures.py", tmp_path, "zero_bubble", timeout=120)
    assert proc.returncode != 0 and took < 60
    lines = _one_line_errors(proc)
    assert len(lines) == 2 and all("ScheduleInterleavedZeroBubble splits each microbatch's backward" in line
                                   for line in lines), proc.stderr[-2000:]


OWN_COLLECTIVE = """
import time
from oneiter.runtime.distributed import all_gather_objects, cpu_device, process_group, rank_info
info = rank_info()
with process_group(cpu_device(), info, 2.0):
    if info.rank == 1:
        time.sleep(60)
    all_gather_objects(info.rank)
"""


def test_oneiters_own_collectives_time_out_and_end_the_process_in_one_line():
    """What `compare` under torchrun gathers over its processes waits at most its timeout for a late one."""
    from test_multirank import _free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", OWN_COLLECTIVE], env={**env, "RANK": str(r)}, text=True,
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL) for r in (0, 1)]
    try:
        err = procs[0].communicate(timeout=60)[1]
        took, late_still_asleep = time.monotonic() - started, procs[1].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if "OneIterError:" in line]
    assert procs[0].returncode != 0 and took < 60 and late_still_asleep, (took, err[-2000:])
    assert lines and "oneiter's all-gather over the job's processes failed on this process" in lines[0], err[-2000:]
