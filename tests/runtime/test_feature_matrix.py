"""Features that combine: {one process, DDP, FSDP2, tensor parallelism} x {`--steps`, `--compile --compile-modules`,
`--level stats`, bf16 autocast, activation checkpointing} record, replay and compare as each does alone, on one small
model (`tests/model_files/matrix.py`), every recording made by `oneiter record` itself (`matrix_run.py`).

Each cell: a clean replay compares as MATCH on every rank, and a replay whose model code scales `blocks.1.up`'s output
by 1.05 (on rank 1 under torchrun) names it: the layer and phase (a compiled block when it hides the layer), its step
for `--steps`. A cell that cannot work is refused up front with one line and exit 2 (`REFUSED`). Every file the
matrix writes reads back: `inspect`, `compare` and `replay --layer` take it, or refuse it in one line where a layer
cannot be replayed from it (several steps, a rank's shard).

Costs: one in-process run of the one-process cells (`one`, ~20 s, most of it inductor's first compile) and one
two-rank torchrun launch for the three others (`ranks`, ~60 s on 2 cores); both are module fixtures shared by every
test here. `python bench/feature_matrix.py` prints the matrix with each cell's seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import assert_reads_back

import oneiter
from oneiter.api import compare_ranks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import matrix_run  # noqa: E402

FEATURES = ("steps", *matrix_run.FEATURES)
RUNS = ("one", "ddp", "fsdp2", "tp")
FAULTY = {"one": None, "ddp": 1, "fsdp2": 1, "tp": 1}  # the rank the fault hits (None: the one process)
REFUSED = {  # (run, feature) -> the one line its replay is refused with (exit 2), on every rank
    ("tp", "compile"): "error: the reference ran a collective (all_reduce) in blocks.0.down, which runs inside the "
                       "compiled block blocks.0 here: compiled code reduces other values than eager code",
}
BLOCK = "blocks.1"  # the compiled block that holds the faulty layer


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("matrix")
    matrix_run.record_run(folder / "one", "one")
    return folder


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    from test_multirank import _free_port

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs gloo")
    folder = tmp_path_factory.mktemp("matrix_ranks")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / "matrix_run.py"), str(folder), "ddp", "fsdp2", "tp"]
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


def _folder(run: str, one: Path, ranks: Path) -> Path:
    return (one if run == "one" else ranks) / run


def _pairs(run: str, folder: Path, feature: str, kind: str) -> list[tuple[int | None, Path, Path]]:
    """(rank, reference file, target file) of a cell's replay `kind` (clean, fault), per rank."""
    ref = "steps_ref" if feature == "steps" else "ref"
    suffixes = [(None, ".h5")] if run == "one" else [(r, f".rank{r}.h5") for r in (0, 1)]
    return [(r, folder / f"{ref}{s}", folder / f"{feature}_{kind}{s}") for r, s in suffixes]


def _cells(folder: Path, run: str) -> list[dict]:
    names = ["cells.rank0.json"] if run == "one" else ["cells.rank0.json", "cells.rank1.json"]
    return [json.loads((folder / n).read_text()) for n in names]


def _runs_of(request, run: str) -> Path:
    if run == "one":
        return _folder(run, request.getfixturevalue("one"), None)
    return _folder(run, None, request.getfixturevalue("ranks"))


def _marks(run: str):
    return [pytest.mark.slow] if run != "one" else []


CELLS = [pytest.param(run, feature, marks=_marks(run), id=f"{run}-{feature}") for run in RUNS for feature in FEATURES]


@pytest.mark.parametrize("run, feature", CELLS)
def test_each_cell_replays_clean_as_a_match_and_names_the_fault(request, run, feature):
    folder = _runs_of(request, run)
    for cells in _cells(folder, run):
        assert all(r["code"] == 0 for r in cells["reference"]["runs"]), cells["reference"]
        runs = cells[feature]["runs"]
        if (run, feature) in REFUSED:  # refused up front: the clean replay already, with one line, exit 2
            assert [(r["code"], r["error"].startswith(REFUSED[run, feature])) for r in runs] == [(2, True)], runs
            continue
        assert [r["code"] for r in runs] == [0, 0], runs
    if (run, feature) in REFUSED:
        return
    for rank, ref, tgt in _pairs(run, folder, feature, "clean"):
        verdict = oneiter.compare(ref, tgt).verdict()
        assert verdict["status"] == "match", (rank, verdict["headline"])
    for rank, ref, tgt in _pairs(run, folder, feature, "fault"):
        verdict = oneiter.compare(ref, tgt).verdict()
        if feature == "steps":  # the band names the first step the fault acts in, on every rank it reaches
            assert (verdict["status"], verdict["step"]) == ("diverged", matrix_run.FAULT_FROM), (rank, verdict)
        elif rank == FAULTY[run]:
            layer = BLOCK if feature == "compile" else matrix_run.FAULT_LAYER
            basis = "first_divergence" if feature == "stats" else "local_error"  # statistics: no per-call rerun
            assert (verdict["status"], verdict["basis"], verdict["module"], verdict["phase"]) == (
                "diverged", basis, layer, "forward"), (rank, verdict["headline"])
        elif feature != "stats":  # the other rank's own calls: teacher forced, a match despite the reduction
            assert verdict["status"] == "match", (rank, verdict["headline"])


@pytest.mark.slow
def test_a_compiled_block_under_ddp_is_the_culprit_on_its_rank_across_ranks(ranks):
    """The rank-by-rank comparison of the DDP cell's faulty compiled replay: rank 1's block, rank 0 a match, and
    every collective (DDP's buckets) judged."""
    data = compare_ranks(ranks / "ddp" / "ref.h5", ranks / "ddp" / "compile_fault.h5")
    assert (data.status, data.origin) == ("diverged", 1)
    verdicts = {rank: result.verdict() for rank, result in data.results.items()}
    assert (verdicts[1]["module"], verdicts[1]["phase"], verdicts[1]["basis"]) == (BLOCK, "forward", "local_error")
    assert verdicts[0]["status"] == "match"


WRITERS = [  # (run, file stem, whether `replay --layer` refuses it)
    (run, stem, stem != "ref" or run in ("fsdp2", "tp"))
    for run in RUNS for stem in ("ref", "steps_ref", "stats_clean")]


@pytest.mark.parametrize("run, stem, refused", [pytest.param(*w, marks=_marks(w[0]), id=f"{w[0]}-{w[1]}")
                                                for w in WRITERS])
def test_every_file_the_cli_writes_reads_back(request, run, stem, refused):
    """One iteration (`record`), several steps (`--steps`) and statistics (`--level stats`), in one process and per
    rank under DDP, FSDP2 and tensor parallelism: `inspect` and `compare` take them, `replay --layer` replays a layer
    of a full one-iteration file (a DDP rank's gradients judged against its own, before DDP averaged them) and refuses
    in one line the others: several steps, statistics, a rank's shard of a model split over ranks."""
    folder = _runs_of(request, run)
    names = [f"{stem}.h5"] if run == "one" else [f"{stem}.rank{r}.h5" for r in (0, 1)]
    for name in names:
        assert_reads_back(folder / name, "blocks.0", matrix_run.SPEC, refused=refused)
