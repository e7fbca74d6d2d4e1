"""Every rank's collectives judged against the exact result of every rank's recorded inputs.

Sits beside `ranks.py`, which compares a multi-rank run rank by rank: each rank's file holds the collectives it ran
(`/collectives/<index>`, `record/modes/collectives.py`), with its own inputs and what it received. One collective
is one *instance* on every rank of its group: the `group_seq`-th collective each of them ran on that group (torch
requires every rank of a group to issue its collectives in one order). For each instance the exact result is
computed in float64 from every member's recorded inputs, one member at a time (memory: two float64 copies of one
tensor), and each member's output is judged against it:

- `all_reduce` (sum, avg, product), `reduce_scatter`: a correct reduction in dtype `d` over `n` ranks errs, in any
  order, at most `(n - 1) u_d` times the sum of the magnitudes it adds, element by element (`u_d` the unit roundoff;
  the standard bound of recursive summation); its expected noise is that bound's norm relative to the exact
  result's: a reduction in another order than the reference's, or in a wider accumulator, is within it; one that
  accumulates in a narrower dtype, drops a rank's contribution or is off on one rank is not;
- `all_reduce` min/max and the bitwise reductions, `all_gather`, `all_to_all`, `broadcast`: no arithmetic, so the
  exact result is the recorded inputs themselves and the output must equal it bit for bit (expected noise 0).

At `--level stats` a rank's tensors are statistics: an all-reduce's (and an all-gather's, a broadcast's) output is
then judged by its sum against the sum of the inputs' sums, with the same bound on the sums of magnitudes; other ops
are not judged there.

A collective is flagged when its error exceeds `factor` (the noise policy's, 4) times its expected noise, or (no
arithmetic) when it is not bitwise; `collective_finding` turns the first flagged collective of a rank into that
rank's `collective` finding (`findings.PRIORITY`: above every other, since it is judged on its own inputs), with its
causal position across ranks: the row where its result first shows (its owner's outputs or input gradients, or, for
a gradient bucket, the first parameter gradient). `consumed` gives blame (`blame.Sources`) each call's collectives as
values its own code computed from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from oneiter.errors import FormatError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import P2P_OPS, ROOT_MODULE, collective_group, collective_index, decode, split_call_key
from oneiter.judge.iteration.findings import Finding
from oneiter.runtime.precision import unit_roundoff

__all__ = ["Judged", "Instance", "read_plans", "instances", "judge", "judge_files", "consumed", "step_reduced",
           "collective_finding", "EXACT_OPS"]

EXACT_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")  # what the judge computes
_SUMS = ("sum", "avg", "premul_sum")
_NO_ARITHMETIC = ("min", "max", "band", "bor", "bxor")


@dataclass(frozen=True)
class Judged:
    """One rank's collective against the exact result of its group's recorded inputs."""

    rank: int
    index: int  # this rank's collective number (`/collectives/<index>`)
    op: str
    reduce_op: str
    group: str
    group_ranks: tuple[int, ...]
    group_seq: int
    phase: str
    call: str
    site: str
    via: str
    bucket: int
    dtype: str
    rel_l2: float  # ||output - exact|| / ||exact||
    max_abs: float
    expected: float  # the reduction-order noise of its dtype and group size (0: no arithmetic, bitwise)
    exact: str  # what the exact result is, in words
    level: str = "data"  # "data", or "statistics" (`--level stats`: sums only)
    reason: str = ""  # why it could not be judged the usual way (ranks that disagree), or ""
    peer: int = -1  # a point-to-point op's other rank (`transfers.py`); -1 for a collective
    tag: int = 0
    microbatch: int = -1  # the microbatch a point-to-point op moved; -1: a collective (not said)

    @property
    def ratio(self) -> float:
        if self.expected > 0:
            return self.rel_l2 / self.expected
        return 0.0 if self.rel_l2 == 0 else math.inf

    def flagged(self, factor: float) -> bool:
        return bool(self.reason) or not self.ratio <= factor  # NaN is flagged too

    @property
    def kind(self) -> str:
        """`transfer` for a point-to-point op (send, recv), `collective` for every other."""
        return "transfer" if self.op in P2P_OPS else "collective"

    @property
    def name(self) -> str:
        """`all_reduce #0 (group 1 of ranks [0, 1], blocks.0.fc2@0 forward at tensor_parallel.py:50 in forward)`;
        a transfer's `recv from rank 0 #3 (microbatch 1, forward at pipeline.py:30 in step, ...)`."""
        if self.op in P2P_OPS:
            return self._transfer_name()
        reduce = f" {self.reduce_op}" if self.reduce_op and self.op in ("all_reduce", "reduce_scatter") else ""
        where = [f"group {self.group or '?'} of ranks {list(self.group_ranks)}"]
        if self.bucket >= 0:
            where.append(f"{self.phase}, DDP bucket {self.bucket}")
        elif self.call:
            where.append(f"{self.call} {self.phase}" + (f" at {self.site}" if self.site else ""))
        else:
            where.append(self.phase + (f" at {self.site}" if self.site else ""))
        if self.via:
            where.append(f"via {self.via}")
        return f"{self.op}{reduce} #{self.index} ({', '.join(where)})"

    def _transfer_name(self) -> str:
        way = "to" if self.op == "send" else "from"
        where = [f"microbatch {self.microbatch}"] if self.microbatch >= 0 else []
        where.append((f"{self.call} " if self.call else "") + self.phase + (f" at {self.site}" if self.site else ""))
        where += [f"tag {self.tag}"] if self.tag else []
        where += [f"via {self.via}"] if self.via else []
        return f"{self.op} {way} rank {self.peer} #{self.index} ({', '.join(where)})"

    def why(self) -> str:
        """Its error against its expected noise, in the verdict's words."""
        if self.reason:
            return self.reason
        if self.expected == 0:
            return (f"its output differs from {self.exact}, which it must equal bit for bit (rel_l2 "
                    f"{self.rel_l2:.2e}, max_abs {self.max_abs:.2e})")
        what = "sum" if self.level == "statistics" else "output"
        return (f"its {what}'s error rel_l2 {self.rel_l2:.2e} against {self.exact} is {self.ratio:.1f}x its "
                f"expected reduction noise {self.expected:.2e} ({self.dtype}, {len(self.group_ranks)} ranks)")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "group_ranks": list(self.group_ranks), "ratio": self.ratio, "name": self.name,
                "kind": self.kind}


# -- which collectives belong together ------------------------------------------------------------------------------
@dataclass
class Instance:
    """One collective on every rank of its group: rank -> that rank's collective number and attributes."""

    group: str
    group_ranks: tuple[int, ...]
    group_seq: int
    members: dict[int, tuple[int, dict]]


def read_plans(files: dict[int, Path]) -> dict[int, list[tuple[int, dict]]]:
    """rank -> (index, attributes) of every collective its file holds."""
    plans: dict[int, list[tuple[int, dict]]] = {}
    for rank, path in files.items():
        with IterationFile(path) as f:
            plans[rank] = [(_index(name), attrs) for name, attrs in f.collectives()]
    return plans


def instances(plans: dict[int, list[tuple[int, dict]]]) -> list[Instance]:
    """The instances the ranks' collectives form (module docstring), in a stable order."""
    found: dict[tuple, Instance] = {}
    for rank in sorted(plans):
        for index, attrs in plans[rank]:
            if attrs["op"] in P2P_OPS:  # paired send to recv instead (`transfers.py`)
                continue
            key = (str(attrs["group"]), tuple(int(r) for r in attrs["group_ranks"]), int(attrs["group_seq"]))
            found.setdefault(key, Instance(*key, {})).members[rank] = (index, attrs)
    return [found[k] for k in sorted(found, key=lambda k: (k[1], k[0], k[2]))]


# -- judging --------------------------------------------------------------------------------------------------------
class _Files:
    """The target files, opened once each."""

    def __init__(self, files: dict[int, Path]):
        self.paths = files
        self.open: dict[int, IterationFile] = {}

    def __getitem__(self, rank: int) -> IterationFile:
        if rank not in self.open:
            self.open[rank] = IterationFile(self.paths[rank])
        return self.open[rank]

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()


def judge_files(files: dict[int, Path], share: tuple[int, int] = (0, 1)) -> list[Judged]:
    """Judge every collective instance of the ranks' `files` (share `(p, P)`: only the instances p, p + P, ...)."""
    planned = instances(read_plans(files))
    return judge([inst for i, inst in enumerate(planned) if i % share[1] == share[0]], files)


def judge(planned: Iterable[Instance], files: dict[int, Path]) -> list[Judged]:
    """Judge each instance's members (module docstring); a member whose file is not among `files` is skipped."""
    opened = _Files(files)
    out: list[Judged] = []
    try:
        for inst in planned:
            out.extend(_judge_instance(inst, opened))
    finally:
        opened.close()
    return out


def _judge_instance(inst: Instance, files: _Files) -> list[Judged]:
    present = {r: m for r, m in inst.members.items() if r in files.paths}
    if not present:
        return []
    ops = {str(a["op"]) for _, a in present.values()} | {str(a["reduce_op"]) + "@" for _, a in present.values()}
    missing = [r for r in inst.group_ranks if r not in inst.members]
    if len(ops) > 2 or missing:
        why = (f"rank {missing[0]} of its group recorded no collective at this place (place {inst.group_seq} of group "
               f"{inst.group})" if missing else "the ranks of its group ran different collectives at this place")
        return [_result(r, present[r], "", math.inf, math.inf, 0.0, "", reason=why) for r in sorted(present)]
    op = next(iter(present.values()))[1]["op"]
    if op not in EXACT_OPS:
        return []
    judge_op = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
                "all_to_all": _all_to_all, "broadcast": _broadcast}[op]
    try:
        return judge_op(inst, present, files)
    except _Unjudged:
        return []


class _Unjudged(Exception):
    """The instance cannot be judged from what the files hold (statistics of an op judged from data only)."""


def _index(name: str) -> int:
    """The index of a collective's group name (the names are checked on open, `format/validate.py`)."""
    index = collective_index(name)
    assert index is not None  # checked on open
    return index


def _names(f: IterationFile, index: int, kind: str) -> list[str]:
    group = collective_group(index)
    names = sorted((n for n in f.names_in(group) if n.startswith(kind + ".")), key=lambda n: int(n.partition(".")[2]))
    return [f"{group}/{n}" for n in names]


def _tensors(files: _Files, rank: int, index: int, kind: str) -> list[str]:
    return _names(files[rank], index, kind)


def _stats(files: _Files, rank: int, paths: list[str]) -> bool:
    return any(files[rank].is_stats(p) for p in paths)


def _inputs_outputs(files: _Files, present: dict) -> tuple[dict, dict, bool]:
    """Each present rank's input and output tensor paths of the instance, and whether any of them holds statistics
    only (no values to judge element by element)."""
    ins = {r: _tensors(files, r, present[r][0], "input") for r in present}
    outs = {r: _tensors(files, r, present[r][0], "output") for r in present}
    return ins, outs, any(_stats(files, r, outs[r] + ins[r]) for r in present)


def _float64(f: IterationFile, path: str) -> np.ndarray:
    return np.asarray(f.read(path), dtype=np.float64)


def _result(rank: int, member: tuple[int, dict], dtype: str, rel: float, max_abs: float, expected: float,
            exact: str, level: str = "data", reason: str = "") -> Judged:
    index, a = member
    return Judged(rank=rank, index=index, op=str(a["op"]), reduce_op=str(a["reduce_op"]), group=str(a["group"]),
                  group_ranks=tuple(int(r) for r in a["group_ranks"]), group_seq=int(a["group_seq"]),
                  phase=str(a["phase"]), call=str(a["call"]), site=str(a["site"]), via=str(a["via"]),
                  bucket=int(a["bucket"]), dtype=dtype, rel_l2=rel, max_abs=max_abs, expected=expected, exact=exact,
                  level=level, reason=reason)


def _roundoff(dtype: str) -> float:
    """The unit roundoff of a floating dtype; 0 for integers and booleans (exact)."""
    return unit_roundoff(dtype) if ("float" in dtype or dtype == "bfloat16") else 0.0


def _distance(out: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(rel_l2, max_abs) of `out` against `exact`, both float64, over the positions finite in both; NaN/Inf at
    other positions (or of another sign) than in the exact result: infinitely off."""
    if out.shape != exact.shape:
        return math.inf, math.inf
    finite = np.isfinite(out)
    if not np.array_equal(finite, np.isfinite(exact)) or not np.array_equal(np.isnan(out), np.isnan(exact)) or \
            not np.array_equal(out[np.isinf(out)], exact[np.isinf(exact)]):
        return math.inf, math.inf
    diff = out[finite] - exact[finite]
    norm, dist = float(np.linalg.norm(exact[finite])), float(np.linalg.norm(diff))
    rel = dist / norm if norm else (0.0 if dist == 0 else math.inf)
    return rel, float(np.max(np.abs(diff))) if diff.size else 0.0


def _bitwise(files: _Files, rank: int, path: str, expected: np.ndarray, dtype: str) -> bool:
    raw = files[rank].raw(path)
    return raw.shape == expected.shape and raw.tobytes() == expected.tobytes()


def _member_dtype(files: _Files, rank: int, index: int) -> str:
    paths = _tensors(files, rank, index, "output") or _tensors(files, rank, index, "input")
    return files[rank].dtype_of(paths[0]) if paths else ""


def _reduce(values: list[np.ndarray], how: str) -> np.ndarray:
    if how in ("sum", "avg", "premul_sum"):
        total = np.zeros_like(values[0])
        for v in values:
            total += v
        return total / len(values) if how == "avg" else total
    if how == "product":
        return np.prod(np.stack(values), axis=0)
    if how in ("min", "max"):
        return (np.minimum if how == "min" else np.maximum).reduce(np.stack(values))
    ints = [v.astype(np.int64) for v in values]
    fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[how]
    return fn.reduce(np.stack(ints)).astype(np.float64)


def _noise(values_abs: np.ndarray, exact: np.ndarray, n: int, dtype: str, how: str) -> float:
    """The norm of the elementwise bound of a correct reduction's error (module docstring), relative."""
    u = _roundoff(dtype)
    if how in _NO_ARITHMETIC or u == 0:
        return 0.0
    norm = float(np.linalg.norm(exact[np.isfinite(exact)]))
    if how == "product":
        return (n - 1) * u
    bound = float(np.linalg.norm(values_abs[np.isfinite(values_abs)])) * (n - 1) * u
    if how == "avg":
        bound /= n
    return bound / norm if norm else (0.0 if bound == 0 else math.inf)


def _exact_of(files: _Files, present: dict, paths_of, how: str) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reduction of every member's input (`paths_of(rank)`), and the sum of their magnitudes, one
    member at a time."""
    values: list[np.ndarray] = []
    total: Optional[np.ndarray] = None
    mags: Optional[np.ndarray] = None
    for rank in sorted(present):
        value = _float64(files[rank], paths_of(rank))
        if how in _SUMS:
            total = value.copy() if total is None else total + value
            mags = np.abs(value) if mags is None else mags + np.abs(value)
        else:
            values.append(value)
    if how in _SUMS:
        assert total is not None and mags is not None  # `present` holds a member (`_judge_instance` checks)
        return (total / len(present) if how == "avg" else total), mags
    stacked = _reduce(values, how)
    return stacked, np.abs(np.stack(values)).sum(axis=0)


def _all_reduce(inst: Instance, present: dict, files: _Files) -> list[Judged]:
    first = min(present)
    how = str(present[first][1]["reduce_op"]) or "sum"
    n = len(inst.group_ranks)
    ins, outs, stats_only = _inputs_outputs(files, present)
    if stats_only:
        return _sums(inst, present, files, ins, outs, how)
    results = []
    for i in range(len(outs[first])):
        exact, mags = _exact_of(files, present, lambda r, i=i: ins[r][i], how)
        for rank in sorted(present):
            dtype = files[rank].dtype_of(outs[rank][i])
            noise = _noise(mags, exact, n, dtype, how)
            rel, max_abs = _distance(_float64(files[rank], outs[rank][i]), exact)
            results.append(_result(rank, present[rank], dtype, rel, max_abs, noise,
                                   f"the float64 {how} of the {n} ranks' recorded inputs"))
    return _worst(results)


def _worst(results: list[Judged]) -> list[Judged]:
    """One result per member: its worst tensor (a coalesced collective moves several)."""
    best: dict[int, Judged] = {}
    for r in results:
        held = best.get(r.rank)
        if held is None or (r.ratio > held.ratio) or (r.ratio == held.ratio and r.rel_l2 > held.rel_l2):
            best[r.rank] = r
    return [best[k] for k in sorted(best)]


def _sums(inst: Instance, present: dict, files: _Files, ins: dict, outs: dict, how: str) -> list[Judged]:
    """`--level stats`: the output's sum against the sum of every member's input sums (module docstring)."""
    if how not in ("sum", "avg"):
        raise _Unjudged()
    n = len(inst.group_ranks)
    results = []
    for i in range(len(outs[min(present)])):
        total = mags = 0.0
        for rank in sorted(present):
            stats = files[rank].stats_of(ins[rank][i]).values
            total += stats[3] * stats[0]  # mean x numel
            mags += stats[5]  # abs_sum
        exact = total / n if how == "avg" else total
        for rank in sorted(present):
            dtype = files[rank].dtype_of(outs[rank][i])
            stats = files[rank].stats_of(outs[rank][i]).values
            got = stats[3] * stats[0]
            err = abs(got - exact)
            scale = max(abs(exact), mags * 2.0 ** -40)  # the stats' own float64 sums: relative to the magnitudes
            bound = (n - 1) * _roundoff(dtype) * (mags / n if how == "avg" else mags) + mags * 2.0 ** -40
            results.append(_result(rank, present[rank], dtype, err / scale, err, bound / scale,
                                   f"the sum of the {n} ranks' recorded input sums", level="statistics"))
    return _worst(results)


def _reduce_scatter(inst: Instance, present: dict, files: _Files) -> list[Judged]:
    first = min(present)
    how = str(present[first][1]["reduce_op"]) or "sum"
    n = len(inst.group_ranks)
    ins, outs, stats_only = _inputs_outputs(files, present)
    if stats_only:
        raise _Unjudged()
    listed = len(ins[first]) == n * len(outs[first])  # reduce_scatter_: one input per (output, destination)
    results = []
    for i in range(len(outs[first])):
        for rank in sorted(present):
            g = inst.group_ranks.index(rank)
            if listed:
                exact, mags = _exact_of(files, present, lambda r, i=i, g=g: ins[r][i * n + g], how)
            else:
                exact, mags = _exact_of(files, present, lambda r, i=i: ins[r][i], how)
                exact, mags = np.array_split(exact, n)[g], np.array_split(mags, n)[g]
            dtype = files[rank].dtype_of(outs[rank][i])
            rel, max_abs = _distance(_float64(files[rank], outs[rank][i]), exact)
            results.append(_result(rank, present[rank], dtype, rel, max_abs, _noise(mags, exact, n, dtype, how),
                                   f"rank {rank}'s part of the float64 {how} of the {n} ranks' recorded inputs"))
    return _worst(results)


def _gathered(files: _Files, present: dict, ins: dict, index: int, part) -> list[tuple[int, np.ndarray]]:
    return [(r, files[r].raw(ins[r][index]) if part is None else part(r, files[r].raw(ins[r][index])))
            for r in sorted(present)]


def _no_arithmetic(rank: int, member, files: _Files, path: str, expected_raw: np.ndarray, exact: str) -> Judged:
    f = files[rank]
    dtype = f.dtype_of(path)
    if _bitwise(files, rank, path, expected_raw, dtype):
        return _result(rank, member, dtype, 0.0, 0.0, 0.0, exact)
    got = f.read(path)
    rel, max_abs = _distance(np.asarray(got, dtype=np.float64),
                             np.asarray(decode(expected_raw, dtype), dtype=np.float64))
    return _result(rank, member, dtype, rel if rel > 0 else math.inf, max_abs, 0.0, exact)


def _all_gather(inst: Instance, present: dict, files: _Files) -> list[Judged]:
    first = min(present)
    n = len(inst.group_ranks)
    if set(present) != set(inst.group_ranks):
        raise _Unjudged()
    ins, outs, stats_only = _inputs_outputs(files, present)
    if stats_only:
        raise _Unjudged()
    listed = len(outs[first]) == n * len(ins[first])  # allgather_: one output per (input, source)
    results = []
    for i in range(len(ins[first])):
        parts = [files[r].raw(ins[r][i]) for r in inst.group_ranks]
        whole = np.concatenate([p.reshape((-1,) + p.shape[1:]) if p.ndim else p.reshape(1) for p in parts])
        for rank in sorted(present):
            if listed:
                for g, part in enumerate(parts):
                    results.append(_no_arithmetic(rank, present[rank], files, outs[rank][i * n + g], part,
                                                  f"rank {inst.group_ranks[g]}'s recorded input"))
            else:
                results.append(_no_arithmetic(rank, present[rank], files, outs[rank][i],
                                              whole.reshape(files[rank].shape_of(outs[rank][i])),
                                              f"the {n} ranks' recorded inputs, concatenated"))
    return _worst(results)


def _all_to_all(inst: Instance, present: dict, files: _Files) -> list[Judged]:
    first = min(present)
    n = len(inst.group_ranks)
    if set(present) != set(inst.group_ranks):
        raise _Unjudged()
    ins, outs, stats_only = _inputs_outputs(files, present)
    if stats_only:
        raise _Unjudged()
    results = []
    if len(ins[first]) == n:  # alltoall_: input g goes to rank g, output g comes from rank g
        for rank in sorted(present):
            g = inst.group_ranks.index(rank)
            for s, source in enumerate(inst.group_ranks):
                results.append(_no_arithmetic(rank, present[rank], files, outs[rank][s],
                                              files[source].raw(ins[source][g]), f"rank {source}'s recorded input"))
        return _worst(results)
    chunks = {}
    for source in inst.group_ranks:
        raw = files[source].raw(ins[source][0])
        splits = [int(s) for s in present[source][1]["in_splits"]] or [raw.shape[0] // n] * n
        if sum(splits) != raw.shape[0]:
            raise FormatError(f"'{files.paths[source]}': collective {present[source][0]} splits {splits} do not "
                              f"add up to its input's {raw.shape[0]} rows")
        edges = np.cumsum([0, *splits])
        chunks[source] = [raw[edges[g]:edges[g + 1]] for g in range(n)]
    for rank in sorted(present):
        g = inst.group_ranks.index(rank)
        expected = np.concatenate([chunks[source][g] for source in inst.group_ranks])
        results.append(_no_arithmetic(rank, present[rank], files, outs[rank][0], expected,
                                      f"the rows the {n} ranks' recorded inputs send it"))
    return _worst(results)


def _broadcast(inst: Instance, present: dict, files: _Files) -> list[Judged]:
    first = min(present)
    root = int(present[first][1]["root"])
    if root not in present:
        raise _Unjudged()
    ins = _tensors(files, root, present[root][0], "input")
    results = []
    for rank in sorted(present):
        outs = _tensors(files, rank, present[rank][0], "output")
        if _stats(files, rank, outs) or _stats(files, root, ins):
            raise _Unjudged()
        for i, path in enumerate(outs):
            results.append(_no_arithmetic(rank, present[rank], files, path, files[root].raw(ins[i]),
                                          f"rank {root}'s recorded input"))
    return _worst(results)


# -- what blame and the verdict take --------------------------------------------------------------------------------
def consumed(ref: IterationFile, tgt: IterationFile) -> list[tuple]:
    """Each output of a collective a call's own code ran on the target, as `blame.Sources` takes what a call
    computed from: ((module, call, phase), key, rel_l2 to the reference's, bitwise)."""
    found = []
    theirs = {_index(name): attrs for name, attrs in ref.collectives()}
    for name, attrs in tgt.collectives():
        index = _index(name)
        if not attrs["call"] or attrs["recomputed"]:
            continue
        module, call = split_call_key(str(attrs["call"]))
        owner = (module or ROOT_MODULE, call, str(attrs["phase"]))
        same = theirs.get(index, {}).get("op") == attrs["op"]
        for path in _names(tgt, index, "output"):
            key = (*owner[:2], owner[2], f"collective {index} {path.rpartition('/')[2]}")
            err, exact = _compare(ref, tgt, path) if same else (math.inf, False)
            found.append((owner, key, err, exact))
    return found


def step_reduced(ref: IterationFile, tgt: IterationFile) -> bool:
    """Whether the target's optimizer step ran collectives whose outputs are not the reference's (a tensor-parallel
    step reduces a norm weight's `Partial` gradient): its updates then hold other ranks' values too."""
    for name, attrs in tgt.collectives():
        if attrs["phase"] == "optimizer":
            index = _index(name)
            if any(not _compare(ref, tgt, path)[1] for path in _names(tgt, index, "output")):
                return True
    return False


def _compare(ref: IterationFile, tgt: IterationFile, path: str) -> tuple[float, bool]:
    if not ref.has(path) or ref.is_stats(path) or tgt.is_stats(path) or ref.shape_of(path) != tgt.shape_of(path):
        return math.inf, False
    a, b = ref.raw(path), tgt.raw(path)
    if a.dtype == b.dtype and a.tobytes() == b.tobytes():
        return 0.0, True
    return _distance(np.asarray(tgt.read(path), np.float64), np.asarray(ref.read(path), np.float64))[0], False


def collective_finding(rows: list, judged: list[Judged], factor: float) -> Optional[Finding]:
    """The `collective` finding of a rank's first flagged collective, placed in causal order among the rows of that
    rank's `CompareResult` (module docstring); None: none is flagged."""
    flagged = sorted((j for j in judged if j.flagged(factor)), key=lambda j: j.index)
    if not flagged:
        return None
    first = flagged[0]
    order = _position(rows, first)
    details = {**first.as_dict(), "order": order, "num_flagged": len(flagged)}
    return Finding.of("collective", None, first.why(), collective=details)


def _position(rows: list, judged: Judged) -> int:
    """Where the collective's result first shows in the rank's rows: its owner's outputs (forward) or input
    gradients (backward); a gradient bucket's at the first parameter gradient."""
    if judged.call:
        module, call = split_call_key(judged.call)
        module = module or ROOT_MODULE
        kinds = ("output",) if judged.phase == "forward" else ("grad_input", "grad_kwarg")
        for i, row in enumerate(rows):
            if (row.module, row.call, row.phase) == (module, call, judged.phase) and row.tensor.startswith(kinds):
                return i
    if judged.phase in ("backward", "optimizer"):
        phase = "param_grad" if judged.phase == "backward" else "optimizer"
        return next((i for i, row in enumerate(rows) if row.phase == phase), len(rows))
    return 0
