"""Collectives judged across ranks (`oneiter/judge/iteration/collective_verdict.py`) on rank files whose `/collectives`
are written here with h5py: a correct reduction in any order is within its expected noise, a library 0.1 % off on one
rank, accumulating in bfloat16 or dropping a rank's contribution is not, ops without arithmetic must be bitwise, and
a rank that names a collective the judge puts it in the verdict as the collective. Hostile `/collectives` are
refused when a file is opened. (The recording side runs under torchrun: tests/runtime/test_parallel.py.)"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from oneiter.errors import FormatError
from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.collective_verdict import judge_files
from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.ranks import _ranked

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from rank_files import _record  # noqa: E402

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("collectives")
    ref, tgt = folder / "ref.h5", folder / "tgt.h5"
    _record(ref)
    _record(tgt, replay=ref)
    return ref, tgt


def ranks(base, folder: Path, n: int) -> dict[int, Path]:
    files = {}
    for rank in range(n):
        path = folder / f"t.rank{rank}.h5"
        shutil.copyfile(base[1], path)
        with h5py.File(path, "r+") as f:
            f.attrs["rank"], f.attrs["world_size"] = rank, n
        files[rank] = path
    return files


def add(path: Path, index: int, op: str, inputs: list, outputs: list, *, group_ranks, reduce_op="sum",
        group_seq: int | None = None, call="", root=-1, in_splits=(), out_splits=(), **extra) -> None:
    attrs = {"op": op, "kernel": f"c10d.{op}_.default", "reduce_op": reduce_op, "group": "0",
             "group_ranks": np.array(group_ranks, np.int64), "group_seq": index if group_seq is None else group_seq,
             "root": root, "phase": "forward", "call": call, "site": "model.py:1 in forward", "via": "",
             "bucket": -1, "recomputed": False, "seq": 1000 + index,
             "in_splits": np.array(in_splits, np.int64), "out_splits": np.array(out_splits, np.int64), **extra}
    with h5py.File(path, "r+") as f:
        group = f.require_group(f"collectives/{index:05d}")
        group.attrs.update(attrs)
        for kind, tensors in (("input", inputs), ("output", outputs)):
            for i, t in enumerate(tensors):
                group.create_dataset(f"{kind}.{i}", data=t).attrs["dtype"] = str(t.dtype)
        f["collectives"].attrs["num_ops"] = len(f["collectives"])


def _sum32(parts, order) -> np.ndarray:
    acc = np.zeros_like(parts[0])
    for i in order:
        acc = (acc + parts[i]).astype(np.float32)
    return acc


def test_a_correct_reduction_in_any_order_is_within_noise_a_wrong_one_is_not(base, tmp_path):
    files = ranks(base, tmp_path, 4)
    parts = [RNG.standard_normal(4096).astype(np.float32) for _ in range(4)]
    outs = {0: _sum32(parts, [0, 1, 2, 3]), 1: _sum32(parts, [3, 2, 1, 0]), 2: _sum32(parts, [1, 3, 0, 2]),
            3: _sum32(parts, [0, 1, 2, 3]) * np.float32(1 + 1e-3)}  # rank 3's library is 0.1 % off
    for rank, path in files.items():
        add(path, 0, "all_reduce", [parts[rank]], [outs[rank]], group_ranks=[0, 1, 2, 3])
    judged = {j.rank: j for j in judge_files(files)}
    assert not any(judged[r].flagged(4.0) for r in (0, 1, 2))
    assert all(judged[r].ratio <= 1.0 for r in (0, 1, 2))  # the bound holds for every order
    assert judged[0].expected == pytest.approx(3 * 2.0 ** -24 * np.linalg.norm(np.abs(np.stack(parts)).sum(0)) /
                                               np.linalg.norm(np.stack(parts).astype(np.float64).sum(0)))
    assert judged[3].flagged(4.0) and judged[3].rel_l2 == pytest.approx(1e-3, rel=1e-3) and judged[3].ratio > 1e3


def test_bfloat16_accumulation_and_a_dropped_rank_are_beyond_the_noise(base, tmp_path):
    files = ranks(base, tmp_path, 2)
    parts = [RNG.standard_normal(512).astype(np.float32) for _ in range(2)]
    import torch

    bf16 = (torch.from_numpy(parts[0]).bfloat16() + torch.from_numpy(parts[1]).bfloat16()).float().numpy()
    for rank, path in files.items():
        add(path, 0, "all_reduce", [parts[rank]], [bf16], group_ranks=[0, 1])
        add(path, 1, "all_reduce", [parts[rank]], [parts[0].copy()], group_ranks=[0, 1])  # rank 1's lost
    judged = {(j.rank, j.index): j for j in judge_files(files)}
    assert all(judged[(r, 0)].flagged(4.0) and judged[(r, 0)].ratio > 1e3 for r in (0, 1))  # ~2**-8 vs 2**-24
    assert all(judged[(r, 1)].rel_l2 > 0.5 and judged[(r, 1)].flagged(4.0) for r in (0, 1))


def test_gather_all_to_all_broadcast_and_reduce_scatter_are_judged_exactly(base, tmp_path):
    files = ranks(base, tmp_path, 2)
    a, b = (RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    gathered = np.concatenate([a, b])
    bad = gathered.copy()
    bad[4, 1] = np.nextafter(bad[4, 1], np.float32(np.inf))  # one ulp
    send = [np.arange(10, dtype=np.float32).reshape(5, 2), 100 + np.arange(6, dtype=np.float32).reshape(3, 2)]
    # rank 0 sends its first 2 rows to itself, 3 to rank 1; rank 1 sends 1 row to rank 0, 2 to itself
    splits = {0: ([2, 3], [2, 1]), 1: ([1, 2], [3, 2])}
    got = {0: np.concatenate([send[0][:2], send[1][:1]]), 1: np.concatenate([send[0][2:], send[1][1:]])}
    full = [RNG.standard_normal(8).astype(np.float32) for _ in range(2)]
    scattered = (full[0] + full[1]).reshape(2, 4)
    for rank, path in files.items():
        add(path, 0, "all_gather", [(a, b)[rank]], [gathered if rank == 0 else bad], group_ranks=[0, 1])
        add(path, 1, "all_to_all", [send[rank]], [got[rank]], group_ranks=[0, 1], in_splits=splits[rank][0],
            out_splits=splits[rank][1], reduce_op="")
        add(path, 2, "broadcast", [(a, b)[rank]], [a], group_ranks=[0, 1], root=0, reduce_op="")
        add(path, 3, "reduce_scatter", [full[rank]], [scattered[rank]], group_ranks=[0, 1])
    judged = {(j.rank, j.index): j for j in judge_files(files)}
    assert not judged[(0, 0)].flagged(4.0) and judged[(0, 0)].expected == 0
    assert judged[(1, 0)].flagged(4.0) and judged[(1, 0)].ratio == math.inf and "bit for bit" in judged[(1, 0)].why()
    assert not any(judged[(r, i)].flagged(4.0) for r in (0, 1) for i in (1, 2, 3))
    assert "rows the 2 ranks' recorded inputs send it" in judged[(0, 1)].exact
    # shares of the instances (what the processes of `torchrun -m oneiter compare` take) add up to the whole
    shares = judge_files(files, (0, 3)) + judge_files(files, (1, 3)) + judge_files(files, (2, 3))
    assert sorted((j.rank, j.index, j.rel_l2) for j in shares) == sorted((j.rank, j.index, j.rel_l2)
                                                                        for j in judged.values())


def test_a_rank_missing_its_collective_is_flagged_and_named_in_the_verdict(base, tmp_path):
    files = ranks(base, tmp_path, 2)
    x = RNG.standard_normal(16).astype(np.float32)
    add(files[0], 0, "all_reduce", [x], [x * 2], group_ranks=[0, 1], call="2@0")
    add(files[0], 1, "all_reduce", [x], [x * 2 * np.float32(1.01)], group_ranks=[0, 1], call="2@0")
    add(files[1], 0, "all_reduce", [x], [x * 2], group_ranks=[0, 1], call="2@0")
    judged = judge_files(files)
    assert [(j.rank, j.index, bool(j.reason)) for j in judged] == [(0, 0, False), (1, 0, False), (0, 1, True)]
    assert "rank 1 of its group recorded no collective at this place" in judged[2].reason
    results = {r: compare_files(base[0], path) for r, path in files.items()}
    ranked = _ranked("ref", "tgt", results, judged, 4.0)
    assert (ranked.status, ranked.origin) == ("diverged", 0)
    verdict = ranked.results[0].verdict()
    assert verdict["focus"] == "collective" and verdict["collective"]["index"] == 1
    assert verdict["headline"].startswith("DIVERGED at collective all_reduce sum #1 (group 0 of ranks [0, 1], 2@0 "
                                          "forward at model.py:1 in forward)")
    assert ranked.verdict_obj.headline.startswith("DIVERGED on rank 0 at collective all_reduce sum #1")
    assert ranked.results[1].status == "match" and ranked.to_json()["collectives"]["num_flagged"] == 1


@pytest.mark.parametrize("change, message", [
    (lambda g: g.attrs.__setitem__("op", "allreduce"), "op 'allreduce' is not one of"),
    (lambda g: g.attrs.__setitem__("group_ranks", np.array([1], np.int64)), "do not hold this file's rank 0"),
    (lambda g: g.attrs.__setitem__("group_ranks", np.array([0, 0], np.int64)), "are not distinct ranks"),
    (lambda g: g.attrs.__setitem__("phase", "sideways"), "phase 'sideways'"),
    (lambda g: g.attrs.__setitem__("call", "nowhere@0"), "call 'nowhere@0' is not a call of the file"),
    (lambda g: g.attrs.__setitem__("group_seq", "3"), "attribute 'group_seq': expected an integer"),
    (lambda g: g.attrs.__delitem__("site"), "attribute 'site': expected a string"),
    (lambda g: g.attrs.__setitem__("in_splits", np.array([1], np.int64)), "split sizes"),
    (lambda g: g.move("input.0", "input.1"), "input tensors are numbered [1]"),
    (lambda g: g.move("input.0", "weights"), "expected a collective's tensor named input.<i> or output.<i>"),
    (lambda g: g.file["collectives"].move("00000", "00007"), "first missing: 0"),
    (lambda g: g.file["collectives"].attrs.__setitem__("num_ops", 2 ** 62), "says num_ops"),
])
def test_hostile_collectives_are_refused_when_the_file_is_opened(base, tmp_path, change, message):
    path = ranks(base, tmp_path, 2)[0]
    x = np.ones(4, np.float32)
    add(path, 0, "all_reduce", [x], [x * 2], group_ranks=[0, 1])
    IterationFile(path).close()  # as written: valid
    with h5py.File(path, "r+") as f:
        change(f["collectives/00000"])
    with pytest.raises(FormatError, match=message.replace("[", r"\[").replace("(", r"\(")):
        IterationFile(path)
