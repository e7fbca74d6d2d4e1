"""The functions of the public API that read recordings: `oneiter.compare` and `oneiter.inspect`.

(`oneiter.Recorder`, which writes them, lives in `record/recorder.py`.) The CLI's `compare` and `inspect` commands
call these, so a script gets exactly what the terminal shows: the same rows, verdict and culprit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

from oneiter.errors import OneIterError
from oneiter.format.inspection import summarize_file
from oneiter.judge.iteration import ranks
from oneiter.judge.iteration.engine import compare_files, compare_local
from oneiter.judge.measure.tolerance_file import FileTolerance, load_tolerance_file
from oneiter.judge.stepwise.step_compare import compare_steps, is_steps
from oneiter.runtime.distributed import RankInfo

__all__ = ["compare", "compare_ranks", "inspect"]


def compare(
    reference: str | os.PathLike,
    target: str | os.PathLike | None = None,
    *,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    tolerances: str | os.PathLike | None = None,
):
    """Compare two recordings (or judge one `against="cpu"` recording alone when `target` is None). Two
    multi-step recordings (`record --steps`) are compared step by step: a `judge.stepwise.step_compare.StepsResult`,
    whose verdict names the first step outside the band (`.step`) and the commands recording it in full.

    `rtol`/`atol` override every entry's tolerance; `tolerances` names a per-device tolerance file (.toml, or an
    mmengine .py config — a Python file, which is executed). Returns the `CompareResult`::

        result = oneiter.compare("ref.h5", "npu.h5")
        result.status          # "match", "diverged" or "inconclusive" (nothing could be judged, or a calibration
                               # not trusted and nothing else found)
        result.culprit         # the call whose own computation is to blame: .module .call .phase .tensor .index
                               # (its row) .ratio .reason; None when no call is
        result.exit_code       # what `oneiter compare` exits with: 0 match, 1 diverged, 2 inconclusive
        result.to_json()       # the JSON report: verdict, counts, every row
        result.verdict_obj     # the whole Verdict: basis, chain, first_divergence, headline, details, counts
        result.rows, result.notes  # rows in causal order; warnings about the comparison itself
    """
    spec, policies = _policies(rtol, atol, tolerances)
    if target is not None and (is_steps(reference) or is_steps(target)):  # iteration by iteration
        if rtol is not None or atol is not None or tolerances is not None:
            raise OneIterError("rtol, atol and tolerances apply to one iteration's entries: two multi-step "
                               "recordings are compared step by step against the band (docs/steps.md)",
                               param="tolerances")
        return compare_steps(reference, target)
    if target is None:
        result = compare_local(reference, **policies)
    else:
        result = compare_files(reference, target, **policies)
    result.notes = [*result.notes, *_device_notes(spec, [result.meta_target])]
    return result


def compare_ranks(
    reference: str | os.PathLike,
    target: str | os.PathLike,
    *,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    tolerances: str | os.PathLike | None = None,
    processes: RankInfo | None = None,
    report: Optional[Callable[[Any], None]] = None,
):
    """Compare two multi-rank runs (directories, or the `-o` name of `ref.rank<R>.h5` files) rank by rank, and
    every rank's collectives against its group's recorded inputs; multi-step recordings step by step, per rank.
    `processes`: this process's place in a torchrun job that shares the work (`torchrun -m oneiter compare`,
    `ranks.compare_ranks_distributed`): process 0 gets the result, the others its exit code (an int). `report`,
    when given, is called with the result where it is made (under torchrun: on process 0 while the others wait, so
    that torchrun, which stops the whole job when one process exits non-zero, cannot stop it mid-report)."""
    spec, policies = _policies(rtol, atol, tolerances)

    def finish(result):
        result.notes = [*result.notes, *_device_notes(spec, [r.meta_target for r in result.results.values()])]
        if report is not None:
            report(result)

    if processes is not None and processes.distributed:
        return ranks.compare_ranks_distributed(reference, target, processes, pair=_compare_pair, report=finish,
                                               **policies)
    result = ranks.compare_ranks(reference, target, pair=_compare_pair, **policies)
    finish(result)
    return result


def _compare_pair(reference, target, **policies):
    """One rank's pair: two recordings of one iteration, or two multi-step recordings step by step (what
    `compare` does for one pair; a module-level function, so worker processes can run it)."""
    if is_steps(reference) or is_steps(target):
        if any(policies.get(k) is not None for k in ("rtol", "atol", "tolerance")):
            raise OneIterError("rtol, atol and tolerances apply to one iteration's entries: two multi-step "
                               "recordings are compared step by step against the band (docs/steps.md)",
                               param="tolerances")
        return compare_steps(reference, target)
    return compare_files(reference, target, **policies)


def inspect(path: str | os.PathLike):
    """What one recording holds: its metadata and every tensor with shape, dtype and statistics (`FileSummary`)."""
    return summarize_file(path)


def _policies(rtol, atol, tolerances) -> tuple[Any, dict]:
    """The tolerance file (or None) and compare_files' keyword arguments: rtol/atol, the file's policy and noise."""
    spec = policy = noise = None
    if tolerances is not None:
        spec = load_tolerance_file(Path(tolerances))
        policy, noise = FileTolerance(spec, atol=atol, rtol=rtol), spec.noise
    return spec, {"rtol": rtol, "atol": atol, "tolerance": policy, "noise": noise}


def _device_notes(spec, metas: list[dict]) -> list[str]:
    """A tolerance file written for another device type than the target's: one note per mismatch."""
    if spec is None:
        return []
    return sorted({spec.device_mismatch(meta.get("device")) for meta in metas} - {None})
