"""Blame: the layer whose *own* computation is wrong, and where NaN/Inf first appear.

Sits after the engine's accumulated rows. A target differs from the reference a little in every layer (bf16
kernels, other accumulation orders), so accumulated error grows with depth and the first entry over a fixed
tolerance is usually not the broken layer. Recordings made with local data (`record --replay`, teacher-forced;
`record --against cpu`) hold, for every leaf layer, its error on trustworthy inputs: free of upstream drift.

A layer is *flagged* when its local rel-L2 error exceeds `factor` times its expected noise, where the expected
noise is the larger of
- the calibrated noise stored with the recording (the same layer, same inputs, run on the CPU in the target's
  precision, against the float32 reference), and
- a floor of `floor_ulps` unit roundoffs of the tensor's dtype (2^-24 for float32, 2^-8 for bfloat16, ...).
The **culprit** is the first flagged layer in causal order: forward as executed, then backward as computed.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Optional

from ..fileformat import BACKWARD, CALLS, FORWARD, LOCAL, IterationFile
from .metrics import Metrics, compare_arrays

__all__ = ["UNIT_ROUNDOFF", "NoisePolicy", "LocalResult", "local_results", "find_culprit", "nan_origin"]

UNIT_ROUNDOFF = {
    "float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4, "float8_e4m3fnuz": 2.0**-4, "float8_e5m2": 2.0**-3, "float8_e5m2fnuz": 2.0**-3,
}


@dataclass
class NoisePolicy:
    """How far above its expected noise a layer's local error may go (per-module overrides from a tolerance file)."""

    factor: float = 4.0
    """A layer is flagged when local rel-L2 > factor x expected noise."""
    floor_ulps: float = 1.0
    """The expected noise is at least this many unit roundoffs of the tensor's dtype."""
    overrides: list[tuple[str, float]] = field(default_factory=list)
    """(module glob, factor) pairs; the last matching one wins."""
    skip: list[str] = field(default_factory=list)
    """Module globs never flagged (their local error is still shown)."""

    def factor_for(self, module: str) -> float:
        factor = self.factor
        for pattern, value in self.overrides:
            if fnmatch.fnmatchcase(module, pattern):
                factor = value
        return factor

    def skipped(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, pattern) for pattern in self.skip)

    def floor(self, dtype: str) -> float:
        return self.floor_ulps * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"])


@dataclass
class LocalResult:
    """One leaf layer's local error for one tensor (forward output or backward grad_input)."""

    module: str
    call: int
    phase: str
    tensor: str
    dtype: str
    metrics: Metrics
    calibrated: Optional[float]
    expected: float
    factor: float
    flagged: bool

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.module, self.call, self.phase, self.tensor)

    @property
    def rel_l2(self) -> float:
        return self.metrics.rel_l2

    @property
    def ratio(self) -> float:
        return self.metrics.rel_l2 / self.expected if self.expected else (0.0 if self.metrics.rel_l2 == 0 else float("inf"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "rel_l2": self.rel_l2, "max_abs": self.metrics.max_abs, "expected": self.expected,
            "calibrated": self.calibrated, "ratio": self.ratio, "factor": self.factor, "flagged": self.flagged,
        }

    def verdict(self) -> dict[str, Any]:
        return {"module": self.module, "call": self.call, "phase": self.phase, "tensor": self.tensor,
                "local_rel_l2": self.rel_l2, "expected": self.expected, "ratio": self.ratio}


def local_results(ref: Optional[IterationFile], tgt: IterationFile, noise: NoisePolicy, tolerance) -> list[LocalResult]:
    """Local error of every leaf tensor the target recorded, in causal order.

    teacher_forced: the target's rerun (`local/`) against the reference file's own values;
    against_cpu: the target's own values against its float32 CPU recomputation (`local/`).
    """
    kind = tgt.local_kind()
    if not kind or (kind == "teacher_forced" and ref is None):
        return []
    ordered = []
    for entry in tgt.entries(local=True):
        live = f"{CALLS}/{_key(entry)}/{entry.phase}/{entry.tensor}"
        source = ref if kind == "teacher_forced" else tgt
        if not source.has(live):
            continue
        reference, target = (ref.read(live), tgt.read(entry.path)) if kind == "teacher_forced" else (
            tgt.read(entry.path), tgt.read(live))
        dtype = tgt.dtype_of(live if kind == "against_cpu" else entry.path)
        if reference.shape != target.shape:
            continue
        tol = tolerance(entry, dtype)
        metrics = compare_arrays(reference, target, atol=tol.atol, rtol=tol.rtol)
        calibrated = tgt.attrs(f"{CALLS}/{_key(entry)}/{LOCAL}").get(f"noise.{entry.tensor}")
        ordered.append(((entry.phase != FORWARD, entry.seq),
                        _judge(entry, dtype, metrics, calibrated, max(calibrated or 0.0, noise.floor(dtype)), noise)))
    if kind == "teacher_forced":
        ordered += _random_layers(ref, tgt, noise, tolerance)
    return [result for _, result in sorted(ordered, key=lambda item: item[0])]


def _judge(entry, dtype: str, metrics: Metrics, calibrated, expected: float, noise: NoisePolicy) -> LocalResult:
    factor = noise.factor_for(entry.module)
    flagged = (not noise.skipped(entry.module)) and (metrics.rel_l2 > factor * expected or metrics.nonfinite_differs)
    return LocalResult(entry.module, entry.call, entry.phase, entry.tensor, dtype, metrics, calibrated, expected,
                       factor, flagged)


def _random_layers(ref: IterationFile, tgt: IterationFile, noise: NoisePolicy, tolerance) -> list:
    """Layers that draw random numbers (dropout) cannot be rerun; judge them by error growth instead.

    Their output's accumulated error may not exceed `factor` times their input's (or the dtype floor): with the
    reference's random values replayed, dropout passes its input's error through; with other masks it explodes.
    """
    by_call: dict[tuple[str, int], list] = {}
    for entry in tgt.entries():
        if entry.phase in (FORWARD, BACKWARD):
            by_call.setdefault((entry.module, entry.call), []).append(entry)
    found = []
    for key, attrs in tgt.calls():
        if tgt.attrs(f"{CALLS}/{key}/{LOCAL}").get("skipped") != "random":
            continue
        entries = by_call.get((attrs["module"] or "(root)", int(attrs["call"])), [])
        for phase, ins, outs in ((FORWARD, ("input", "kwarg"), ("output",)), (BACKWARD, ("grad_output",), ("grad_input",))):
            errors = {}
            for e in entries:
                if e.phase == phase and ref.has(e.path):
                    a, b = ref.read(e.path), tgt.read(e.path)
                    if a.shape == b.shape:
                        tol = tolerance(e, tgt.dtype_of(e.path))
                        errors[e] = compare_arrays(a, b, atol=tol.atol, rtol=tol.rtol)
            e_in = max((m.rel_l2 for e, m in errors.items() if e.tensor.startswith(ins)), default=0.0)
            for e, m in errors.items():
                if e.tensor.startswith(outs):
                    dtype = tgt.dtype_of(e.path)
                    found.append(((phase != FORWARD, e.seq),
                                  _judge(e, dtype, m, None, max(e_in, noise.floor(dtype)), noise)))
    return found


def _key(entry) -> str:
    return entry.path.split("/")[1]


def find_culprit(results: list[LocalResult]) -> Optional[LocalResult]:
    """The first flagged layer in causal order (results are already ordered)."""
    return next((r for r in results if r.flagged), None)


def nan_origin(counts: dict[tuple[str, int, str, str], int], order: list[tuple[str, int, str, str]]) -> Optional[dict]:
    """The first module call whose outputs hold NaN/Inf while its inputs do not.

    `counts` maps entry keys to the target's number of non-finite elements, `order` lists the keys in causal
    order. Forward: outputs vs inputs of a call; backward: grad_input vs grad_output of a call.
    """
    inputs: dict[tuple[str, int, str], int] = {}
    for key in order:
        module, call, phase, tensor = key
        if phase in (FORWARD, BACKWARD) and key in counts and _is_input(tensor):
            inputs[(module, call, phase)] = inputs.get((module, call, phase), 0) + counts[key]
    for key in order:  # the first non-finite *output* in causal order whose call had finite inputs
        module, call, phase, tensor = key
        if phase in (FORWARD, BACKWARD) and counts.get(key) and not _is_input(tensor):
            if not inputs.get((module, call, phase)):
                return {"module": module, "call": call, "phase": phase, "tensor": tensor}
    return None


def _is_input(tensor: str) -> bool:
    """Inputs of a call: forward inputs/kwargs, and in backward the gradients w.r.t. its outputs."""
    return tensor.startswith(("input", "kwarg", "grad_output"))
