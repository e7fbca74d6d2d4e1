"""`oneiter replay --layer` judged: each tensor one recorded layer produced again against its recording.

`oneiter.record.replay.layer_replay.run_layer` runs the layer (forward from its recorded inputs, backward from its
recorded output gradients) and hands each output, input gradient and attributable parameter gradient to
`check_tensor` as a host array: bitwise equal, or within the default tolerance of the looser of the two dtypes
with the same NaN/Inf. `replay_layer` is the two together, what the CLI command and the tests call.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oneiter.format.layout import IterationFile
from oneiter.format.schema import decode
from oneiter.judge.measure.metrics import compare_arrays
from oneiter.judge.measure.tolerance import default_tolerance, looser
from oneiter.record.replay.layer_replay import RECORDED, LayerRun, run_layer

__all__ = ["TensorCheck", "LayerReplayResult", "replay_layer", "check_tensor"]


@dataclass(frozen=True)
class TensorCheck:
    """One replayed tensor against its recording: `output`, `grad_input.0`, `param_grad.weight`, ..."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bitwise: bool
    max_abs: float
    rel_l2: float
    atol: float
    rtol: float
    matched: bool
    """Bitwise equal, or within (atol, rtol) of the recorded tensor's dtype with the same NaN/Inf."""


@dataclass
class LayerReplayResult(LayerRun):
    """What `replay_layer` found: the run, with a `TensorCheck` per tensor."""

    @property
    def matched(self) -> bool:
        return all(c.matched for c in self.checks)

    @property
    def bitwise(self) -> bool:
        return all(c.bitwise for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (non-finite errors become null)."""
        data = asdict(self)
        for check in data["checks"]:
            check["shape"] = list(check["shape"])
            for key in ("max_abs", "rel_l2"):
                check[key] = check[key] if math.isfinite(check[key]) else None
        data.update(key=self.key, matched=self.matched, bitwise=self.bitwise, timing=self.timing())
        return data


def replay_layer(
    path: str | Path, layer: str, *, call: int = 0, device: str = "cpu", repeat: int = 1, dtype: str | None = None,
    model: str | None = None, amp: str | None = RECORDED, compile: str | None = None, float8: str | None = None,
) -> LayerReplayResult:
    """Run call `call` of module `layer` of the recording at `path` on `device`: once (untimed) to judge it, then
    `repeat` timed runs (`run_layer` says what each argument means)."""
    run = run_layer(path, layer, check_tensor, call=call, device=device, repeat=repeat, dtype=dtype, model=model,
                    amp=amp, compile=compile, float8=float8)
    return LayerReplayResult(**vars(run))


def check_tensor(name: str, ref: IterationFile, path: str, got: tuple[np.ndarray, str] | None) -> TensorCheck:
    """`got` (the produced tensor as a host array and its dtype name, None when the replay did not produce it)
    against the recorded `path`."""
    want_shape, want_dtype = ref.shape_of(path), ref.dtype_of(path)
    if got is None:
        return TensorCheck(name=name, shape=want_shape, dtype=want_dtype, bitwise=False, max_abs=math.inf,
                           rel_l2=math.inf, atol=0.0, rtol=0.0, matched=False)
    array, dtype = got
    shape = tuple(array.shape)
    tol = looser(default_tolerance(want_dtype), default_tolerance(dtype))
    if shape != want_shape:
        return TensorCheck(name=name, shape=shape, dtype=dtype, bitwise=False, max_abs=math.inf, rel_l2=math.inf,
                           atol=tol.atol, rtol=tol.rtol, matched=False)
    bitwise = dtype == want_dtype and array.tobytes() == np.asarray(ref.raw(path)).tobytes()
    metrics = compare_arrays(ref.read(path), decode(array, dtype), atol=tol.atol, rtol=tol.rtol)
    matched = bitwise or not metrics.diverged
    return TensorCheck(name=name, shape=shape, dtype=dtype, bitwise=bitwise, max_abs=metrics.max_abs,
                       rel_l2=metrics.rel_l2, atol=tol.atol, rtol=tol.rtol, matched=matched)
