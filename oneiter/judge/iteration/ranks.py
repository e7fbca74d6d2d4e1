"""Compare the recordings of a multi-rank run rank by rank: one verdict per rank, and one overall.

Sits beside `engine.compare_files` (which judges one pair) and is what `oneiter compare` runs when it is given
two directories, or two names such as `ref.h5` that do not exist while `ref.rank0.h5`, `ref.rank1.h5`... do
(written by `torchrun ... -m oneiter record -o ref.h5`, see `oneiter.runtime.distributed`). Files are paired by rank,
each pair is compared in its own process (`ProcessPoolExecutor`, at most one worker per CPU), and

- each rank gets the verdict `compare_files` gives its pair (two multi-step recordings: the first step outside the
  band, with `pair` dispatching to their comparison);
- every rank's collectives are judged against the exact reduction of their group's recorded inputs
  (`collective_verdict.py`), and every point-to-point transfer's receive against its send (`transfers.py`): a rank's
  first wrong one is its `collective` finding (a transfer's: named as the transfer);
- the overall verdict (`judge.iteration.verdict.decide_ranked`) is a divergence if any rank diverged, and names the
  rank whose
  divergence comes first in causal order (ties: the lowest rank). Gradients are averaged across ranks (DDP's
  allreduce), so a fault on one rank also changes every other rank's parameter gradients and updated weights; those
  ranks diverge later (at param_grad) or, with teacher-forced local data, not at all, and the rank where the error
  started is named.

A rank present on one side only, or missing from a run (0..N-1 with N the recorded `world_size`), is an input
error (the CLI exits 2), never a pass. Under torchrun (`compare_ranks_distributed`) the processes of the job share
the pairs and the collective instances, and process 0 gathers the one result. Limits: the pairs are judged
independently; nothing here checks that the ranks' own inputs differ.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from oneiter.errors import FormatError, OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import COLLECTIVES
from oneiter.formatting import json_ready
from oneiter.judge.iteration.collective_verdict import Judged, collective_finding, read_plans
from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.transfers import judge_planned, plan
from oneiter.judge.iteration.verdict import RankedVerdict, decide_ranked
from oneiter.judge.measure.tolerance import NoisePolicy
from oneiter.runtime.distributed import (
    LOOKS_RANKED,
    RANK_FILE,
    RankInfo,
    all_gather_objects,
    broadcast_object,
    cpu_device,
    dist_timeout,
    gather_objects,
    process_group,
)

__all__ = ["RankedResult", "find_rank_files", "is_ranked", "compare_ranks", "compare_ranks_distributed"]


@dataclass
class RankedResult:
    """One `CompareResult` per rank (ascending), and what the user named on each side."""

    reference: str
    target: str
    results: dict[int, CompareResult]
    notes: list[str] = field(default_factory=list)
    """Warnings about the comparison itself (e.g. a tolerance file written for another device)."""
    collectives: list[Judged] = field(default_factory=list)
    """Every rank's collectives judged against its group's recorded inputs (`collective_verdict.py`), by rank and
    index."""
    factor: float = 4.0
    """How far above its expected noise a collective may go (the noise policy's factor)."""

    @functools.cached_property
    def verdict_obj(self) -> RankedVerdict:
        """The overall verdict, combined once from each rank's (`judge.iteration.verdict.decide_ranked`)."""
        return decide_ranked({rank: result.verdict_obj for rank, result in self.results.items()})

    @property
    def diverged_ranks(self) -> list[int]:
        return list(self.verdict_obj.diverged_ranks)

    @property
    def status(self) -> str:
        return self.verdict_obj.status

    @property
    def origin(self) -> Optional[int]:
        """The rank the overall verdict names: the diverged rank whose divergence comes first in causal order."""
        return self.verdict_obj.rank

    @property
    def exit_code(self) -> int:
        return self.verdict_obj.exit_code

    def verdict(self) -> dict[str, Any]:
        """The origin rank's verdict with `rank`, plus `num_ranks`, `diverged_ranks` and the overall `headline`;
        `rank` None when no rank diverged."""
        v = self.verdict_obj
        common = {"num_ranks": v.num_ranks, "diverged_ranks": list(v.diverged_ranks), "headline": v.headline}
        if v.rank is None:
            return {"status": v.status, "rank": None, **common}
        return {**self.results[v.rank].verdict(), "rank": v.rank, **common}

    def as_dict(self) -> dict[str, Any]:
        """`{"verdict": {..., "rank": r}, "reference", "target", "ranks": [{"rank", "verdict", "reference", ...}]}`."""
        ranks = [{"rank": rank, "verdict": result.verdict(), "reference": result.reference, "target": result.target,
                  **({"loss": result.loss, "counts": result.counts()} if hasattr(result, "counts") else {})}
                 for rank, result in self.results.items()]
        flagged = [j.as_dict() for j in self.collectives if j.flagged(self.factor)]
        return {"verdict": self.verdict(), "reference": self.reference, "target": self.target, "ranks": ranks,
                "collectives": {"num_judged": len(self.collectives), "num_flagged": len(flagged),
                                "num_transfers": sum(j.kind == "transfer" for j in self.collectives),
                                "flagged": flagged}}

    def to_json(self) -> dict[str, Any]:
        """The machine-readable report (`as_dict`, with inf/nan as the strings JSON needs)."""
        return json_ready(self.as_dict())


# -- finding the files ----------------------------------------------------------------------------------------------
def _stem(path: Path) -> str:
    return path.name[: -len(".h5")] if path.name.endswith(".h5") else path.name


def _rank_files(path: Path) -> list[tuple[str, int, Path]]:
    """(stem, rank, file) for the rank files in a directory, or beside a name `run.h5` (`run.rank<R>.h5`)."""
    if path.is_dir():
        candidates, wanted = path.iterdir(), None
    else:
        candidates, wanted = path.parent.glob("*.rank*.h5"), _stem(path)
    found = []
    for file in candidates:
        looks = LOOKS_RANKED.match(file.name)
        if looks is None or wanted not in (None, looks["stem"]) or not file.is_file():
            continue
        if RANK_FILE.match(file.name) is None:  # rank00, rank0001, a rank of 20 digits: never silently skipped
            raise FormatError(f"'{file}' looks like a rank file but is not named <name>.rank<R>.h5 with R as "
                              f"torchrun numbers ranks (0, 1, ... without leading zeros): rename or remove it")
        found.append((looks["stem"], int(looks["rank"]), file))
    return found


def is_ranked(path: str | os.PathLike) -> bool:
    """A directory, or a name that does not exist while its rank files do: compare it rank by rank."""
    path = Path(path)
    return path.is_dir() or (not path.exists() and bool(_rank_files(path)))


def find_rank_files(path: str | os.PathLike) -> dict[int, Path]:
    """rank -> file for one run: `DIR/<name>.rank<R>.h5`, or `run.rank<R>.h5` for a `run.h5` that does not exist.

    Raises OneIterError for a single recording, no rank files, several runs in one directory, or a rank missing
    from 0..N-1 (N: the recorded `world_size`).
    """
    path = Path(path)
    if path.is_file():
        raise OneIterError(f"'{path}' is a single recording, not a set of rank files: compare it with one "
                           f"rank's file, or give two directories")
    where = f"directory '{path}'" if path.is_dir() else f"'{path}'"
    found = _rank_files(path)
    if not found:
        expected = "<name>.rank<R>.h5 files" if path.is_dir() else f"'{path}' or {_stem(path)}.rank<R>.h5 files"
        raise FormatError(f"{where}: expected {expected}, found none")
    stems = sorted({stem for stem, _, _ in found})
    if len(stems) > 1:
        raise OneIterError(f"{where} holds rank files of {len(stems)} runs ({', '.join(stems)}): give one run, "
                           f"e.g. {path / (stems[0] + '.h5')}")
    files = {rank: file for _, rank, file in sorted(found)}
    world_size = _check_rank_files(files)
    missing = next((r for r in range(len(files) + 1) if r not in files), None)  # sized by the files found
    if len(files) < world_size:
        raise OneIterError(f"{where}: rank {missing} of {world_size} is missing (found ranks "
                           f"{', '.join(map(str, files))})")
    return files


def _check_rank_files(files: dict[int, Path]) -> int:
    """Each rank file records the rank its name says and one world size, which every rank number is below;
    returns that world size."""
    sizes: dict[int, int] = {}
    for rank, file in files.items():
        with IterationFile(file) as f:
            size, own = int(f.meta.get("world_size") or 1), f.meta.get("rank")
        if own is not None and own != rank:
            raise FormatError(f"'{file}' is named rank {rank} but records rank {own}")
        if rank >= size:
            raise FormatError(f"'{file}' is rank {rank}, but its run has world_size {size}: ranks are 0 to "
                              f"{size - 1}")
        sizes[rank] = size
    first = min(sizes)
    for rank, size in sorted(sizes.items()):
        if size != sizes[first]:
            raise FormatError(f"the rank files disagree on the world size: rank {first} says {sizes[first]}, rank "
                              f"{rank} says {size}")
    return sizes[first]


def _check_pairs(refs: dict[int, Path], tgts: dict[int, Path], reference, target) -> None:
    for rank in sorted(set(refs) ^ set(tgts)):
        lacking = "target" if rank in refs else "reference"
        raise OneIterError(f"rank {rank} is missing from the {lacking}: the reference '{reference}' has ranks "
                           f"{', '.join(map(str, refs))}, the target '{target}' has {', '.join(map(str, tgts))}")


# -- comparing ------------------------------------------------------------------------------------------------------
def _judge_pair(pair, reference: Path, target: Path, kwargs: dict) -> tuple[Any, list]:
    """One rank's pair judged (`pair`: `compare_files`, or the caller's dispatch to multi-step recordings), and the
    collectives its target recorded (`collectives.read_plans`)."""
    result = pair(reference, target, **kwargs)
    if not isinstance(result, CompareResult) or not _has_collectives(target):  # multi-step: not judged
        return result, []
    return result, read_plans({0: target})[0]


def _has_collectives(path: Path) -> bool:
    """Whether a recording (read and validated already) holds collectives: one HDF5 lookup instead of a second
    validated open of a file that has none (a run of one process per rank without collectives)."""
    import h5py

    with h5py.File(path, "r") as f:
        return COLLECTIVES in f


def _factor(kwargs: dict) -> float:
    noise = kwargs.get("noise")
    return noise.factor if noise is not None else NoisePolicy().factor


def compare_ranks(
    reference: str | os.PathLike, target: str | os.PathLike, *, max_workers: Optional[int] = None, pair=None,
    **kwargs
) -> RankedResult:
    """Compare `reference` and `target` rank by rank, one process per pair, then judge every rank's collectives
    against its group's recorded inputs (`collective_verdict.py`); `kwargs` go to `compare_files` (rtol, atol,
    tolerance, noise: picklable), `pair` replaces it (a module-level function: `oneiter.api` dispatches multi-step
    recordings to their comparison). A worker's OneIterError comes back prefixed with its rank."""
    refs, tgts = find_rank_files(reference), find_rank_files(target)
    _check_pairs(refs, tgts, reference, target)
    pair = pair or compare_files
    workers = max_workers or min(len(refs), os.cpu_count() or 1)
    # spawn, not fork: the caller may hold torch's thread pools or open HDF5 handles
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {rank: pool.submit(_judge_pair, pair, refs[rank], tgts[rank], kwargs) for rank in refs}
        results, plans = {}, {}
        for rank, future in futures.items():
            try:
                results[rank], plans[rank] = future.result()
            except OneIterError as exc:
                raise type(exc)(f"rank {rank}: {exc}") from None
        planned = plan(plans)
        shares = [pool.submit(judge_planned, planned[p::workers], tgts) for p in range(min(workers, len(planned)))]
        judged = [j for share in shares for j in share.result()]
    return _ranked(reference, target, results, judged, _factor(kwargs))


def _ranked(reference, target, results: dict, judged: list[Judged], factor: float) -> RankedResult:
    """The RankedResult of every rank's result, each rank's first flagged collective among its findings."""
    results = {rank: _with_collective(result, [j for j in judged if j.rank == rank], factor)
               for rank, result in sorted(results.items())}
    notes = sorted({f"rank {rank}: {note}" for rank, r in results.items() for note in r.notes})
    judged = sorted(judged, key=lambda j: (j.rank, j.index))
    return RankedResult(reference=str(reference), target=str(target), results=results, notes=notes,
                        collectives=judged, factor=factor)


def _with_collective(result, judged: list[Judged], factor: float):
    """A rank's `CompareResult` with its first flagged collective among its findings (`collective_verdict.py`)."""
    if not isinstance(result, CompareResult):
        return result
    found = collective_finding(result.rows, judged, factor)
    return result if found is None else replace(result, findings=[*result.findings, found])


def compare_ranks_distributed(
    reference: str | os.PathLike, target: str | os.PathLike, info: RankInfo, *, pair=None, report=None, **kwargs
) -> RankedResult | int:
    """`compare_ranks` spread over the processes of a torchrun job (`info`: this process's place in it): process p
    of P judges the rank pairs p, p + P, ... and the collective instances p, p + P, ... (every file reachable from
    every node: a shared filesystem), and process 0 gathers one RankedResult; the others get its exit code. Every
    process raises the same OneIterError when the files cannot be compared. Communicates over gloo (CPU).
    `report(result)` runs on process 0 before the others get the exit code: torchrun stops every process of the job
    once one exits non-zero (a divergence), so process 0 must have reported by then."""
    pair = pair or compare_files
    # oneiter's own collectives (the plans, the results, the verdict) wait at most ONEITER_DIST_TIMEOUT for a process
    with process_group(cpu_device(), info, dist_timeout()):
        refs, tgts = _shared_pairs(reference, target, info)
        mine, error = {}, None
        for rank in sorted(refs)[info.rank::info.world_size]:
            try:
                mine[rank] = _judge_pair(pair, refs[rank], tgts[rank], kwargs)
            except OneIterError as exc:
                error = type(exc)(f"rank {rank}: {exc}")
                break
        plans = {}
        for part in all_gather_objects({r: plan for r, (_, plan) in mine.items()}):
            plans.update(part)
        planned = plan(plans)
        judged = judge_planned(planned[info.rank::info.world_size], tgts) if error is None else []
        parts = gather_objects(({r: result for r, (result, _) in mine.items()}, judged, error))
        errors = [e for _, _, e in parts or [] if e is not None]
        failed = broadcast_object(errors[0] if errors else None)
        if failed is not None:
            raise failed
        ranked = None
        if parts is not None:
            results = {r: result for part, _, _ in parts for r, result in part.items()}
            ranked = _ranked(reference, target, results, [j for _, js, _ in parts for j in js], _factor(kwargs))
        failure = _reported(ranked, report)
        code = broadcast_object(ranked.exit_code if ranked is not None else None)
    if failure is not None:
        raise failure
    return ranked if ranked is not None else code


def _shared_pairs(reference, target, info: RankInfo) -> tuple[dict[int, Path], dict[int, Path]]:
    """The rank files of both runs, found and checked by process 0 and sent to every process (which all raise its
    OneIterError when they cannot be compared)."""
    found: tuple[dict[int, Path], dict[int, Path]] | OneIterError | None = None
    if info.rank == 0:
        try:
            refs, tgts = find_rank_files(reference), find_rank_files(target)
            _check_pairs(refs, tgts, reference, target)
            found = (refs, tgts)
        except OneIterError as exc:
            found = exc
    found = broadcast_object(found)
    if isinstance(found, OneIterError):
        raise found
    return found


def _reported(ranked: RankedResult | None, report) -> BaseException | None:
    """`report(ranked)` run where the result is (process 0); what it raised, to raise once the others are released."""
    if ranked is None or report is None:
        return None
    try:
        report(ranked)
    except BaseException as exc:  # noqa: BLE001 - raised by the caller after the exit code is sent
        return exc
    return None
