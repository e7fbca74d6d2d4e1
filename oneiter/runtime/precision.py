"""Precision of a run: the model's storage dtype (`--dtype`) and automatic mixed precision (`--amp`)."""

from __future__ import annotations

import math

from oneiter.errors import OneIterError

__all__ = ["DTYPES", "AMP_DTYPES", "UNIT_ROUNDOFF", "NOISE_BOUND_FACTOR", "FLAG_FACTOR", "unit_roundoff",
           "amp_dtype_name", "torch_dtype", "apply_dtype", "autocast_for", "active_autocast", "expected_noise"]

DTYPES = ("float32", "bfloat16", "float16", "float64")
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
UNIT_ROUNDOFF = {
    "float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4, "float8_e4m3fnuz": 2.0**-4, "float8_e5m2": 2.0**-3, "float8_e5m2fnuz": 2.0**-3,
}

# a call's precision-only noise more than this many times what the precision can produce for it (its bound, at least
# one unit roundoff) is no noise (docs/blame.md "A noise estimate is itself checked"): the probe measures the bound
# of a call whose noise is above this many unit roundoffs, the judge holds the noise to it
NOISE_BOUND_FACTOR = 16.0
# a call's own error more than this many times its expected noise is flagged (`judge/measure/tolerance.NoisePolicy`'s
# default factor; `record --impact` chooses its candidates by it, `record/impact/candidates.py`)
FLAG_FACTOR = 4.0


def expected_noise(noise_target: float, noise_reference: float, noise_bound: float, floor: float,
                   run_floor: float) -> tuple[float | None, float, float | None]:
    """(calibrated, expected, bound) of one `/local` row: the one rule of what its own error is held to.

    NaN noise means "not calibrated" (the error was within one unit roundoff), and the expected noise is then the
    larger `floor` of the tensor's dtype and `run_floor` of the run's compute precision; an infinite or negative
    noise is no measurement and falls back to that floor too, never to "anything goes". A calibrated noise more than
    `NOISE_BOUND_FACTOR` times the `bound` (what the precision can produce for the call, measured on the trusted
    path) is no noise: the bound is expected instead. Otherwise the calibrated noise, `floor` at least."""
    stored = (noise_target, noise_reference)
    parts = [v for v in stored if math.isfinite(v) and v >= 0]
    calibrated = sum(parts) if parts and len(parts) == sum(not math.isnan(v) for v in stored) else None
    bound = noise_bound if math.isfinite(noise_bound) and noise_bound >= 0 else None
    if calibrated is None:
        return None, max(floor, run_floor), bound
    if bound is not None and calibrated > NOISE_BOUND_FACTOR * max(bound, floor):
        return calibrated, max(bound, floor), bound
    return calibrated, max(calibrated, floor), bound


def amp_dtype_name(amp) -> str:
    """The dtype name of an `amp` setting as recordings store it: `bf16`/`bfloat16` -> `bfloat16`,
    `fp16`/`float16` -> `float16`, anything else (None, "") -> ""."""
    text = str(amp or "")
    name = AMP_DTYPES.get(text, text)
    return name if name in AMP_DTYPES.values() else ""


def unit_roundoff(dtype_name: str) -> float:
    """The unit roundoff of a floating dtype by name (float32's for anything else, integers included)."""
    return UNIT_ROUNDOFF.get(str(dtype_name).removeprefix("torch."), UNIT_ROUNDOFF["float32"])


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise OneIterError(f"--dtype must be one of {', '.join(DTYPES)}, got '{name}'")
    return getattr(torch, name)


def apply_dtype(bundle, dtype_name: str) -> None:
    """Cast the model's floating parameters/buffers and floating inputs to `dtype_name`, in place on the bundle."""
    dtype = torch_dtype(dtype_name)
    if dtype_name == "float32":
        return
    bundle.model.to(dtype)
    bundle.inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in bundle.inputs)


def autocast_for(device, amp: str | None):
    """A `torch.autocast` context for `--amp bf16|fp16` on `device`, or None without --amp."""
    import torch

    if amp is None:
        return None
    if amp not in AMP_DTYPES:
        raise OneIterError(f"--amp must be one of {', '.join(AMP_DTYPES)}, got '{amp}'")
    return torch.autocast(device_type=device.type, dtype=getattr(torch, AMP_DTYPES[amp]))


def active_autocast(device_type: str) -> str | None:
    """The autocast in force for `device_type` right now, as `amp` names it ("bf16", "fp16"; None: off, or a dtype
    `amp` has no name for)."""
    import torch

    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch < 2.4: no per-device-type query
        if device_type != "cpu" or not torch.is_autocast_cpu_enabled():
            return None
        dtype = torch.get_autocast_cpu_dtype()
    names = {name: short for short, name in AMP_DTYPES.items()}
    return names.get(str(dtype).removeprefix("torch."))
