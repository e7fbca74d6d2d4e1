"""Every point-to-point transfer judged across the two ranks' files: what the receiver got against what the sender
sent.

Sits beside `collective_verdict.py` (whose `Judged` results these are, and whose instances these join in `plan`): each
rank's file holds its sends (the tensor as it was posted) and receives (the tensor as it arrived) under
`/collectives/<index>` (`record/modes/p2p.py`). A transfer is the n-th send from rank a to rank b and the n-th
receive of rank b from rank a on one group and tag (their `p2p_seq`: both backends deliver the messages of one
channel in the order they were posted). A transfer does no arithmetic: the receiver's tensor must equal the
sender's bit for bit (at `--level stats`: the same checksum and statistics). One that does not is flagged on the
receiving rank and named as the transfer (`recv from rank 0 #3 (microbatch 1, forward at ...)`), never as the layer
that consumed what it received (whose rerun got the reference's value, and is clean). A receive no send matches
(or a send no receive matches, on a rank whose file is among those judged) is flagged with that reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np

from oneiter.format.schema import MICROBATCHES, P2P_OPS, decode
from oneiter.judge.iteration.collective_verdict import (
    Instance,
    Judged,
    _Files,
    _float64,
    _names,
    _result,
    instances,
    judge,
)

__all__ = ["pairs", "plan", "judge_planned"]

_KIND = "transfer"


def pairs(plans: dict[int, list[tuple[int, dict]]]) -> list[Instance]:
    """The transfers the ranks' point-to-point ops form: one `Instance` per (group, sender, receiver, tag, place on
    that channel), its members the sender's send and the receiver's receive (either may be missing), its
    `group_ranks` (sender, receiver) and `group_seq` the place."""
    found: dict[tuple, Instance] = {}
    for rank in sorted(plans):
        for index, attrs in plans[rank]:
            if attrs["op"] not in P2P_OPS:
                continue
            peer = int(attrs["peer"])
            ends = (rank, peer) if attrs["op"] == "send" else (peer, rank)
            key = (str(attrs["group"]), ends, int(attrs["tag"]), int(attrs["p2p_seq"]))
            found.setdefault(key, Instance(key[0], ends, key[3], {})).members[rank] = (index, attrs)
    return [found[k] for k in sorted(found, key=lambda k: (k[1], k[0], k[2], k[3]))]


def plan(plans: dict[int, list[tuple[int, dict]]]) -> list[Instance]:
    """Every instance to judge: the collectives' (`collectives.instances`), then the transfers' (`pairs`)."""
    return instances(plans) + pairs(plans)


def judge_planned(planned: Iterable[Instance], files: dict[int, Path]) -> list[Judged]:
    """Judge each planned instance: a collective by `collectives.judge`, a transfer here."""
    planned = list(planned)
    transfers = [inst for inst in planned if _is_transfer(inst)]
    out = judge([inst for inst in planned if not _is_transfer(inst)], files)
    opened = _Files(files)
    try:
        for inst in transfers:
            out.extend(_judge_transfer(inst, opened))
    finally:
        opened.close()
    return out


def _is_transfer(inst: Instance) -> bool:
    return any(attrs["op"] in P2P_OPS for _, attrs in inst.members.values())


def _judged(rank: int, member: tuple[int, dict], dtype: str, rel: float, max_abs: float, exact: str,
            level: str = "data", reason: str = "", several: bool = True) -> Judged:
    """A transfer's result, as a `Judged` (its microbatch said only for an iteration of several)."""
    judged = _result(rank, member, dtype, rel, max_abs, 0.0, exact, level, reason)
    attrs = member[1]
    return Judged(**{**judged.__dict__, "peer": int(attrs["peer"]), "tag": int(attrs["tag"]),
                     "microbatch": int(attrs["microbatch"]) if several else -1})


def _judge_transfer(inst: Instance, files: _Files) -> list[Judged]:
    sender, receiver = inst.group_ranks
    send, recv = inst.members.get(sender), inst.members.get(receiver)
    if send is None or recv is None:
        missing, present = (sender, recv) if send is None else (receiver, send)
        assert present is not None  # an instance holds the member it was found by
        rank = receiver if send is None else sender
        if rank not in files.paths or (missing not in files.paths and send is not None):
            return []  # the other rank's file is not judged here (a pair of rank files)
        what = "send to it" if send is None else "receive of it"
        why = (f"rank {missing} recorded no {what} at this place (transfer {inst.group_seq} from rank {sender} to "
               f"rank {receiver} on group {inst.group})")
        return [_judged(rank, present, "", math.inf, math.inf, "", reason=why)]
    if receiver not in files.paths or sender not in files.paths:
        return []
    several = int(files[receiver].meta.get(MICROBATCHES) or 1) > 1
    sent, got = _names(files[sender], send[0], "input"), _names(files[receiver], recv[0], "output")
    exact = f"the tensor rank {sender} sent (its collective #{send[0]})"
    if len(sent) != len(got):
        why = f"it received {len(got)} tensors where rank {sender} sent {len(sent)}"
        return [_judged(receiver, recv, "", math.inf, math.inf, exact, reason=why, several=several)]
    worst = None
    for a, b in zip(sent, got, strict=True):
        result = _one(files, sender, a, receiver, b, recv, exact, several)
        if worst is None or result.rel_l2 > worst.rel_l2 or (math.isnan(result.rel_l2)):
            worst = result
    return [worst] if worst is not None else []


def _one(files: _Files, sender: int, sent: str, receiver: int, got: str, recv, exact: str, several: bool) -> Judged:
    """One tensor of a transfer: bitwise (full data), or the same checksum and statistics (`--level stats`)."""
    fs, fr = files[sender], files[receiver]
    dtype = fr.dtype_of(got)
    if fs.is_stats(sent) or fr.is_stats(got):
        a, b = fs.stats_of(sent), fr.stats_of(got)
        same = a.checksum == b.checksum and a.kind == b.kind and np.array_equal(a.values, b.values, equal_nan=True)
        rel = 0.0 if same else _stats_distance(a, b)
        return _judged(receiver, recv, dtype, rel, abs(a["mean"] - b["mean"]) if not same else 0.0, exact,
                       level="statistics", several=several)
    raw_sent, raw_got = fs.raw(sent), fr.raw(got)
    if fs.dtype_of(sent) == dtype and raw_sent.shape == raw_got.shape and raw_sent.tobytes() == raw_got.tobytes():
        return _judged(receiver, recv, dtype, 0.0, 0.0, exact, several=several)
    if raw_sent.shape != raw_got.shape:
        return _judged(receiver, recv, dtype, math.inf, math.inf, exact,
                       reason=f"it received shape {list(raw_got.shape)} where rank {sender} sent "
                              f"{list(raw_sent.shape)}", several=several)
    a = np.asarray(decode(raw_sent, fs.dtype_of(sent)), dtype=np.float64)
    b = _float64(fr, got)
    diff = b - a
    norm = float(np.linalg.norm(a[np.isfinite(a)]))
    dist = float(np.linalg.norm(diff[np.isfinite(diff)])) if np.isfinite(diff).any() else math.inf
    rel = dist / norm if norm else math.inf
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    return _judged(receiver, recv, dtype, rel if rel > 0 else math.inf, max_abs, exact, several=several)


def _stats_distance(a, b) -> float:
    """How far two statistics rows are apart, relative to the sent tensor's l2 (inf when that is 0)."""
    l2 = a["l2"]
    gap = abs(a["l2"] - b["l2"]) + abs(a["mean"] - b["mean"]) * math.sqrt(max(a["numel"], 1.0))
    return gap / l2 if l2 and gap else math.inf
