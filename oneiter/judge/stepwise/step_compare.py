"""`oneiter compare` of two multi-step recordings: which iteration first goes wrong, and how to record it in full.

Sits beside the one-iteration engine (`judge/iteration/engine.py`): the files hold one signature row per step
(`format/signature.py`) and each step's statistics. This module checks that the two files can be compared (the
same model; the target a replay of the reference that ran on its batches), then measures each step against its
band (`band.py`) and decides (`step_verdict.py`); `StepsResult` is what `oneiter.compare` returns for them and
every writer (`report/multistep.py`) reads.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any, Optional

from oneiter.errors import FormatError
from oneiter.format.layout import IterationFile, reading
from oneiter.formatting import json_ready
from oneiter.judge.iteration.pairing import check_compatible, check_replay, same_start
from oneiter.judge.stepwise.band import BAND_FACTOR, DECORRELATED, StepRow, distance, step_rows
from oneiter.judge.stepwise.step_verdict import StepVerdict, decide_steps

__all__ = ["BAND_FACTOR", "DECORRELATED", "StepRow", "StepVerdict", "StepsResult", "compare_steps", "distance",
           "is_steps"]

META_KEYS = ("model", "device", "dtype", "amp", "optimizer", "num_threads", "batch_size", "seed", "steps",
             "twin_roundoff", "twin_check")


def is_steps(path) -> bool:
    """Whether the file at `path` is a multi-step recording (its root attribute `steps`; read without validating:
    `compare_steps` opens it properly)."""
    import h5py

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # a FIFO would block h5py's open: the one-iteration path refuses it, in its words
        with h5py.File(path, "r") as f:
            return "steps" in f.attrs
    except Exception:  # noqa: BLE001 - h5py raises OSError, KeyError, ValueError... on a damaged header
        return False  # not readable as HDF5: the one-iteration path says why, in its words


@dataclass
class StepsResult:
    """Two multi-step recordings compared step by step (`compare_steps`)."""

    reference: str
    target: str
    meta_reference: dict[str, Any]
    meta_target: dict[str, Any]
    rows: list[StepRow]
    verdict_obj: StepVerdict
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.verdict_obj.status

    @property
    def exit_code(self) -> int:
        return self.verdict_obj.exit_code

    @property
    def step(self) -> Optional[int]:
        return self.verdict_obj.step

    def verdict(self) -> dict[str, Any]:
        return self.verdict_obj.as_dict()

    def as_dict(self) -> dict[str, Any]:
        impact = self.verdict_obj.impact
        return {"kind": "steps", "verdict": self.verdict(),
                "impact": [f.as_dict() for f in impact.fixes] if impact is not None else None,
                "reference": self.reference, "target": self.target,
                "meta": {"reference": self.meta_reference, "target": self.meta_target},
                "steps": [row.as_dict() for row in self.rows]}

    def to_json(self) -> dict[str, Any]:
        return json_ready(self.as_dict())


def compare_steps(reference, target) -> StepsResult:
    """Compare two multi-step recordings (the target a replay of the reference, ideally: `record --replay`)."""
    with IterationFile(reference) as ref, IterationFile(target) as tgt, reading(reference, target):
        return _compare_open(ref, tgt)


def _compare_open(ref: IterationFile, tgt: IterationFile) -> StepsResult:
    if not (ref.steps() and tgt.steps()):
        one, many = (ref, tgt) if not ref.steps() else (tgt, ref)
        raise FormatError(f"'{many.path}' records {len(many.steps())} steps and '{one.path}' one iteration: compare "
                          f"two multi-step recordings (record --steps), or two of one iteration")
    steps = [s for s in tgt.steps() if s in set(ref.steps())]
    if not steps or steps != ref.steps()[:len(steps)]:
        raise FormatError(f"'{tgt.path}' holds steps {tgt.steps()[:3]}..., not the first steps of '{ref.path}': "
                          f"record the target with --replay {ref.path}")
    first = steps[0]
    check_compatible(ref.step(first), tgt.step(first))
    notes = []
    note = check_replay(ref.step(first), tgt.step(first))
    if note:
        notes.append(note)
    else:
        _check_batches(ref, tgt, steps[1:])
    mine, theirs = ref.signature(), tgt.signature()
    if mine is None or theirs is None:
        raise FormatError(f"'{ref.path if mine is None else tgt.path}' holds no /signature table")
    rows = step_rows(ref, tgt, steps, mine, theirs, tgt.signature(twin=True))
    verdict = decide_steps(ref, tgt, rows, notes)
    return StepsResult(reference=str(ref.path), target=str(tgt.path), meta_reference=_meta(ref),
                       meta_target=_meta(tgt), rows=rows, verdict_obj=verdict, notes=notes)


def _check_batches(ref: IterationFile, tgt: IterationFile, steps: list[int]) -> None:
    """Every later step ran on the reference's batch (checksums): else the two runs saw other data."""
    for step in steps:
        a, b = ref.step(step), tgt.step(step)
        pairs = list(zip(a.batch_paths(), b.batch_paths(), strict=False))
        if len(a.batch_paths()) != len(b.batch_paths()) or not all(same_start(a, b, p, q) for p, q in pairs):
            raise FormatError(f"bad replay: the target's batch of step {step} is not the reference's; record the "
                              f"target again with --replay {ref.path}")


def _meta(f: IterationFile) -> dict[str, Any]:
    first = f.step(f.steps()[0]).meta
    merged = {**first, **f.meta}
    return {k: merged[k] for k in META_KEYS if k in merged}

