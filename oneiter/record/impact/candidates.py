"""Which calls `record --impact` fixes one at a time: every flagged call, largest own error first.

Where this sits: after the teacher-forced probes judged every call (`record/local/probe.py`: its `JudgedRow`s, with
their calibrated noise), before the impact runs (`runs.py`). A row is flagged by the rule compare applies by default
(`runtime/precision.py`: `expected_noise`, `FLAG_FACTOR`): its own error more than 4 times its expected noise, or
NaN/Inf where the reference has none. A call is a candidate when one of its forward or backward rows is flagged — its
own outputs or input gradients, or what its own code hands a child (`layer3.1.conv2@0:input.0`: fixing the call fixes
its own code, what it hands its children included) — or when a parameter gradient it alone produces is (the call of
the parameter's module). Candidates come largest own error (rel_l2) first; `top` keeps that many.

A tolerance file given to `compare` later may flag other calls (`factor`, `skip`): the ranking holds the calls flagged
by default, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import BACKWARD, FORWARD, ROOT_MODULE, LocalRow
from oneiter.record.local.rows import JudgedRow
from oneiter.runtime.precision import FLAG_FACTOR, amp_dtype_name, expected_noise, unit_roundoff

__all__ = ["Candidate", "flagged", "choose", "judged_in"]


@dataclass(frozen=True)
class Candidate:
    """A call to fix in an impact run, and its largest flagged row (what the ranking names it by)."""

    module: str
    """The module path as files name it (`(root)` for the model itself)."""
    call: int
    phase: str
    tensor: str
    rel_l2: float
    ratio: float

    @property
    def path(self) -> str:
        """The module path `named_modules()` gives (`""` for the model itself)."""
        return "" if self.module == ROOT_MODULE else self.module

    @property
    def name(self) -> str:
        return f"{self.module}@{self.call}"


def _ratio(row: JudgedRow, run_dtype: str) -> float:
    """Its own error over its expected noise (inf where NaN/Inf differ), as compare computes it by default."""
    if row.stats.get("mismatch", 0):
        return math.inf
    _, expected, _ = expected_noise(row.noise_target, row.noise_reference, row.noise_bound,
                                    unit_roundoff(row.dtype), unit_roundoff(run_dtype))
    error = row.stats["rel_l2"] if not math.isnan(row.stats["rel_l2"]) else math.inf
    return error / expected if expected else (0.0 if error == 0 else math.inf)


def flagged(rows: Iterable[JudgedRow], run_dtype: str) -> list[tuple[JudgedRow, float]]:
    """The rows whose own error exceeds `FLAG_FACTOR` times their expected noise (or whose NaN/Inf differ), each with
    its ratio."""
    found = []
    for row in rows:
        ratio = _ratio(row, run_dtype)
        if ratio > FLAG_FACTOR:
            found.append((row, ratio))
    return found


def choose(rows: Iterable[JudgedRow], run_dtype: str, top: int | None = None) -> tuple[list[Candidate], int]:
    """The candidates (one per call, largest own error first, at most `top`) and how many calls were flagged. A call
    is named by its largest flagged forward row (else backward row; its parameter gradient's when it has neither)."""
    found: dict[tuple[str, int], list[Candidate]] = {}
    for row, ratio in flagged(rows, run_dtype):
        if row.phase in (FORWARD, BACKWARD):
            key = (row.module, row.call)
        elif row.phase == "param_grad":
            key = (row.module, 0)  # a parameter's gradient: its module's (first) call
        else:
            continue  # the optimizer's update: not a module call
        error = row.stats["rel_l2"] if not math.isnan(row.stats["rel_l2"]) else math.inf
        found.setdefault(key, []).append(Candidate(key[0], key[1], row.phase, row.tensor, error, ratio))
    best = []
    for each in found.values():
        own = [c for c in each if c.phase == FORWARD] or [c for c in each if c.phase == BACKWARD] or each
        named = max(own, key=lambda c: (c.rel_l2, c.ratio))
        largest = max(each, key=lambda c: (c.rel_l2, c.ratio))
        best.append((largest.rel_l2, largest.ratio, named))
    ranked = [c for _, _, c in sorted(best, key=lambda b: (-b[0], -b[1], b[2].module, b[2].call))]
    return (ranked if top is None else ranked[:top]), len(ranked)


def _judged(row: LocalRow) -> JudgedRow:
    stats = {k: getattr(row, k) for k in ("numel", "rel_l2", "max_abs", "cosine", "nan_ref", "inf_ref", "nan", "inf",
                                          "mismatch")}
    return JudgedRow(row.module, row.call, row.phase, row.tensor, row.dtype, stats, row.seq, row.noise_target,
                     row.noise_reference, row.calibration, row.noise_bound)


def judged_in(path) -> tuple[list[JudgedRow], str]:
    """The judged rows of a replay's `/local` table, and the run's compute dtype: the calls a multi-step replay fixes
    at every step (`impact_from`)."""
    with IterationFile(path) as f:
        if f.steps() or f.local_kind() != "teacher_forced":
            raise OneIterError(f"impact_from '{path}' holds no per-call local error of one iteration: give a replay "
                               f"recorded in full with --replay (the `--step S` replay the steps' comparison prints)",
                               param="impact_from")
        run = amp_dtype_name(f.meta.get("amp")) or str(f.meta.get("dtype") or "float32")
        return [_judged(r) for r in f.local_rows()], run
