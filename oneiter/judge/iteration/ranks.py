"""Compare the recordings of a multi-rank run rank by rank: one verdict per rank, and one overall.

Sits beside `engine.compare_files` (which judges one pair) and is what `oneiter compare` runs when it is given
two directories, or two names such as `ref.h5` that do not exist while `ref.rank0.h5`, `ref.rank1.h5`... do
(written by `torchrun ... -m oneiter record -o ref.h5`, see `oneiter.runtime.distributed`). Files are paired by rank,
each pair is compared in its own process (`ProcessPoolExecutor`, at most one worker per CPU), and

- each rank gets the verdict `compare_files` gives its pair;
- the overall verdict (`judge.iteration.verdict.decide_ranked`) is a divergence if any rank diverged, and names the
  rank whose
  divergence comes first in causal order (ties: the lowest rank). Gradients are averaged across ranks (DDP's
  allreduce), so a fault on one rank also changes every other rank's parameter gradients and updated weights; those
  ranks diverge later (at param_grad) or, with teacher-forced local data, not at all, and the rank where the error
  started is named.

A rank present on one side only, or missing from a run (0..N-1 with N the recorded `world_size`), is an input
error (the CLI exits 2), never a pass. Limits: the pairs are judged independently; nothing here checks that the
ranks' own inputs differ, or that the allreduce itself was right (compare two ranks' param_grads for that).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from oneiter.errors import FormatError, OneIterError
from oneiter.format.layout import IterationFile
from oneiter.formatting import json_ready
from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.verdict import RankedVerdict, decide_ranked
from oneiter.runtime.distributed import LOOKS_RANKED, RANK_FILE

__all__ = ["RankedResult", "find_rank_files", "is_ranked", "compare_ranks"]


@dataclass
class RankedResult:
    """One `CompareResult` per rank (ascending), and what the user named on each side."""

    reference: str
    target: str
    results: dict[int, CompareResult]
    notes: list[str] = field(default_factory=list)
    """Warnings about the comparison itself (e.g. a tolerance file written for another device)."""

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
                  "loss": result.loss, "counts": result.counts()} for rank, result in self.results.items()]
        return {"verdict": self.verdict(), "reference": self.reference, "target": self.target, "ranks": ranks}

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
def compare_ranks(
    reference: str | os.PathLike, target: str | os.PathLike, *, max_workers: Optional[int] = None, **kwargs
) -> RankedResult:
    """Compare `reference` and `target` rank by rank, one process per pair; `kwargs` go to `compare_files`
    (rtol, atol, tolerance, noise: picklable). A worker's OneIterError comes back prefixed with its rank."""
    refs, tgts = find_rank_files(reference), find_rank_files(target)
    _check_pairs(refs, tgts, reference, target)
    workers = max_workers or min(len(refs), os.cpu_count() or 1)
    # spawn, not fork: the caller may hold torch's thread pools or open HDF5 handles
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {rank: pool.submit(compare_files, refs[rank], tgts[rank], **kwargs) for rank in refs}
        results = {}
        for rank, future in futures.items():
            try:
                results[rank] = future.result()
            except OneIterError as exc:
                raise type(exc)(f"rank {rank}: {exc}") from None
    notes = sorted({f"rank {rank}: {note}" for rank, r in results.items() for note in r.notes})
    return RankedResult(str(reference), str(target), results, notes)
