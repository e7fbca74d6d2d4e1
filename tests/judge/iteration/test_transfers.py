"""Point-to-point transfers judged across ranks (`oneiter/judge/iteration/transfers.py`) on rank files whose
`/collectives` are written here with h5py: the n-th send from rank a to rank b pairs with the n-th receive of rank b
from rank a whatever else either rank ran; what arrived bit for bit as it was sent is not flagged, what differs is
named as the transfer (on the receiving rank, in the verdict's words), a receive no send matches is flagged with why,
and a point-to-point op whose attributes make no sense is refused when the file is opened. (The recording side runs
under torchrun: tests/runtime/test_pipelines.py.)"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from test_collective_verdict import add, base, ranks  # noqa: F401 - `base` is a fixture

from oneiter.errors import FormatError
from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.collective_verdict import read_plans
from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.ranks import _ranked
from oneiter.judge.iteration.transfers import judge_planned, pairs, plan

RNG = np.random.default_rng(1)


def p2p(path, index: int, op: str, tensor: np.ndarray, *, peer: int, seq: int, microbatch: int = 0, tag: int = 0,
        phase: str = "forward") -> None:
    """A send (`input.0`) or receive (`output.0`) written as `record/modes/p2p.py` writes it."""
    kind = {"send": ([tensor], []), "recv": ([], [tensor])}[op]
    add(path, index, op, *kind, group_ranks=[0, 1], reduce_op="", group_seq=-1, peer=peer, tag=tag, p2p_seq=seq,
        microbatch=microbatch)
    if phase != "forward":
        with h5py.File(path, "r+") as f:
            f[f"collectives/{index:05d}"].attrs["phase"] = phase


def _two(base, tmp_path, microbatches: int = 1):  # noqa: F811 - the fixture
    """Two rank files of an iteration of `microbatches` (a recording of one, its root attribute and losses set)."""
    files = ranks(base, tmp_path, 2)
    for path in files.values():
        if microbatches > 1:
            with h5py.File(path, "r+") as f:
                f.attrs["microbatches"] = microbatches
                f.create_dataset("microbatch_loss", data=np.ones(microbatches)).attrs["dtype"] = "float64"
    return files


def test_sends_pair_with_receives_by_their_place_on_the_channel(base, tmp_path):  # noqa: F811
    files = _two(base, tmp_path, 4)
    acts = [RNG.standard_normal((2, 8)).astype(np.float32) for _ in range(3)]
    grad = RNG.standard_normal((2, 8)).astype(np.float32)
    # rank 0: send 0, send 1, recv (a gradient), send 2; rank 1: recv 0, send (the gradient), recv 1, recv 2
    for i, (op, t, seq) in enumerate([("send", acts[0], 0), ("send", acts[1], 1), ("recv", grad, 0),
                                      ("send", acts[2], 2)]):
        p2p(files[0], i, op, t, peer=1, seq=seq, microbatch=min(seq, 3))
    for i, (op, t, seq) in enumerate([("recv", acts[0], 0), ("send", grad, 0), ("recv", acts[1], 1),
                                      ("recv", acts[2], 2)]):
        p2p(files[1], i, op, t, peer=0, seq=seq, microbatch=min(seq, 3))
    found = pairs(read_plans(files))
    assert [(inst.group_ranks, inst.group_seq, {r: m[0] for r, m in inst.members.items()}) for inst in found] == [
        ((0, 1), 0, {0: 0, 1: 0}), ((0, 1), 1, {0: 1, 1: 2}), ((0, 1), 2, {0: 3, 1: 3}), ((1, 0), 0, {0: 2, 1: 1})]
    judged = judge_planned(plan(read_plans(files)), files)
    assert [(j.rank, j.op, j.peer, j.rel_l2) for j in judged] == [(1, "recv", 0, 0.0)] * 3 + [(0, "recv", 1, 0.0)]
    assert not any(j.flagged(4.0) for j in judged)


def test_a_transfer_that_arrives_changed_is_named_on_the_receiving_rank_as_the_transfer(base, tmp_path):  # noqa: F811
    files = _two(base, tmp_path, 4)
    sent = RNG.standard_normal((2, 8)).astype(np.float32)
    p2p(files[0], 0, "send", sent, peer=1, seq=0, microbatch=2)
    p2p(files[1], 0, "recv", sent * np.float32(1 + 1e-3), peer=0, seq=0, microbatch=2)
    judged = judge_planned(plan(read_plans(files)), files)
    assert len(judged) == 1 and judged[0].flagged(4.0)
    transfer = judged[0]
    assert (transfer.rank, transfer.kind, transfer.expected) == (1, "transfer", 0.0)
    assert transfer.rel_l2 == pytest.approx(1e-3, rel=1e-3)
    assert transfer.name == "recv from rank 0 #0 (microbatch 2, forward at model.py:1 in forward)"
    results = {r: compare_files(base[0], path) for r, path in files.items()}
    ranked = _ranked("ref", "tgt", results, judged, 4.0)
    verdict = ranked.verdict()
    assert (ranked.status, ranked.origin, verdict["focus"]) == ("diverged", 1, "collective")
    assert verdict["headline"] == ("DIVERGED on rank 1 at transfer recv from rank 0 #0 (microbatch 2, forward at "
                                   "model.py:1 in forward) (1 of 2 ranks diverged)")
    assert ranked.results[1].verdict()["headline"].startswith("DIVERGED at transfer recv from rank 0 #0")
    assert ranked.as_dict()["collectives"]["num_transfers"] == 1


def test_a_receive_no_send_matches_is_flagged_with_the_reason(base, tmp_path):  # noqa: F811
    files = _two(base, tmp_path)
    p2p(files[1], 0, "recv", RNG.standard_normal(4).astype(np.float32), peer=0, seq=0)
    (judged,) = judge_planned(plan(read_plans(files)), files)
    assert judged.rank == 1 and judged.flagged(4.0)
    assert judged.reason == "rank 0 recorded no send to it at this place (transfer 0 from rank 0 to rank 1 on group 0)"


@pytest.mark.parametrize("change,why", [
    ({"peer": 1}, "peer 1 is not another rank of its group"),
    ({"group_seq": 0}, "a point-to-point op has no place on its group"),
    ({"microbatch": -1}, "tag, p2p_seq and microbatch must be >= 0"),
    ({"microbatch": 1}, "microbatch 1 is not one the iteration ran"),
])
def test_a_point_to_point_op_whose_attributes_make_no_sense_is_refused(base, tmp_path, change, why):  # noqa: F811
    files = _two(base, tmp_path)
    p2p(files[1], 0, "recv", RNG.standard_normal(4).astype(np.float32), peer=0, seq=0)
    with h5py.File(files[1], "r+") as f:
        f["collectives/00000"].attrs.update(change)
    with pytest.raises(FormatError, match=why):
        IterationFile(files[1])
