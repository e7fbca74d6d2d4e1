"""Reproducer of one aten op, written by `oneiter replay --ops --repro DIR` as DIR/repro.py beside DIR/case.h5.

    python repro.py [--device D] [--plugin MODULE] [--case FILE]

runs the op once on the device D (default: the one oneiter traced it on; its vendor plugin, which the case names from
oneiter's device table, is imported, or name one with --plugin), and once on the CPU in float64 (floating inputs and
dtype arguments widened), both on the inputs stored in the case, with their strides and storage offsets. It prints
both errors (rel_l2 against the float64 run): the device's and the CPU's own in the op's dtypes, then the op's
expected noise (what its precision does to a correct kernel, measured by oneiter), and exits 1 when the device's
error exceeds `factor` times that noise (or NaN/Inf sit elsewhere, or integer outputs differ), 0 when it does not, 2
when the case cannot run here.

It imports nothing of oneiter: torch, h5py, numpy and the standard library only, so a vendor runs it as it is. The
case is data (HDF5, no pickle); the op's arguments are JSON, never code. Layout of case.h5, in the spirit of DIOPI's
test cases (inputs by argument name, expected outputs, atol/rtol, at most 0.1 % of elements outside them)::

    /                    attrs format, version, op ("aten::silu"), namespace, name, overload, phase, line, node,
                         device, layer, recording, args (JSON), expected_noise, factor, error (oneiter's),
                         reference, rtol, atol, mismatch_ratio_threshold, plugins (JSON: device type -> the
                         vendor plugin that registers it)
    /inputs/<arg>        each tensor argument's storage: elements 0..the end of its layout, attrs dtype, shape,
                         stride, storage_offset (a list argument's tensors: <arg>.<i>)
    /outputs/<i>         the expected outputs: the op rerun on the CPU in float64 (`reference` says how), attrs dtype
    /target_outputs/<i>  what the traced device produced, attrs dtype

bfloat16 (and float8) data is stored as its raw bits with the torch dtype name in `dtype`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

FORMAT, VERSION = "oneiter.op_case", 1
CASE, SCRIPT = "case.h5", "repro.py"
INPUTS, OUTPUTS, TARGET_OUTPUTS = "inputs", "outputs", "target_outputs"
RAW_BITS = {"bfloat16": (np.uint16, torch.int16), "float8_e4m3fn": (np.uint8, torch.uint8),
            "float8_e5m2": (np.uint8, torch.uint8), "float8_e4m3fnuz": (np.uint8, torch.uint8),
            "float8_e5m2fnuz": (np.uint8, torch.uint8)}
MISMATCH_RATIO = 1e-3  # DIOPI's rule: a case passes when at most this share of elements is outside atol/rtol
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# -- the stored values ------------------------------------------------------------------------------------------------


def to_storage(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A host tensor's flat storage (its dtype as stored, raw bits for bfloat16/float8) and its dtype name."""
    name = str(tensor.dtype).removeprefix("torch.")
    flat = tensor.detach().reshape(-1).contiguous()
    if name in RAW_BITS:
        return flat.view(RAW_BITS[name][1]).numpy().view(RAW_BITS[name][0]), name
    return flat.numpy(), name


def from_storage(array: np.ndarray, name: str) -> torch.Tensor:
    """The tensor of `to_storage`, bit for bit."""
    array = np.ascontiguousarray(array)
    if name in RAW_BITS:
        return torch.from_numpy(array.view(RAW_BITS[name][0]).copy()).view(RAW_BITS[name][1]).view(getattr(torch, name))
    return torch.from_numpy(array.copy())


def read_tensor(dset) -> torch.Tensor:
    """An input as the op saw it: its storage laid out with the recorded shape, strides and storage offset."""
    storage = from_storage(dset[()], str(dset.attrs["dtype"]))
    shape = [int(s) for s in dset.attrs["shape"]]
    stride = [int(s) for s in dset.attrs["stride"]]
    return storage.as_strided(shape, stride, int(dset.attrs["storage_offset"]))


def decode(value, tensors: dict, device):
    """The JSON of an argument back to Python: tensors by name (on `device`), dtypes, devices, layouts."""
    if isinstance(value, list):
        return [decode(v, tensors, device) for v in value]
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "device" in value:
        return device
    if "float" in value:
        return float(value["float"])
    if "layout" in value:
        return getattr(torch, value["layout"])
    if "memory_format" in value:
        return getattr(torch, value["memory_format"])
    raise ValueError(f"unknown argument encoding {sorted(value)}")


def the_op(attrs):
    """`torch.ops.<namespace>.<name>.<overload>`, after checking the names are identifiers."""
    names = [str(attrs[k]) for k in ("namespace", "name", "overload")]
    if not all(_NAME.fullmatch(n) for n in names):
        raise ValueError(f"not an op name: {'.'.join(names)}")
    return getattr(getattr(getattr(torch.ops, names[0]), names[1]), names[2])


# -- running and judging ----------------------------------------------------------------------------------------------


def run(op, case: dict, tensors: dict, device, dtype=None) -> list:
    """The op's tensor outputs for inputs moved to `device` (floating ones cast to `dtype`), on the host."""
    moved = {}
    for name, tensor in tensors.items():
        value = tensor
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        moved[name] = _on(value, device)
    args = decode(case["args"], moved, device)
    kwargs = {key: decode(value, moved, device) for key, value in case["kwargs"].items()}
    if dtype is not None:
        args, kwargs = _widen_dtypes(args, dtype), _widen_dtypes(kwargs, dtype)
    with torch.no_grad():
        result = op(*args, **kwargs)
    flat = result if isinstance(result, (tuple, list)) else [result]
    return [t.detach().cpu() for t in flat if isinstance(t, torch.Tensor)]


def _on(tensor: torch.Tensor, device) -> torch.Tensor:
    """A fresh copy of `tensor` on `device` with its strides and storage offset (its storage up to the layout's last
    element moves, and is viewed the same way there)."""
    if tensor.numel() == 0:
        return tensor.to(device, copy=True)
    extent = tensor.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    base = tensor.as_strided((extent,), (1,), 0).to(device, copy=True)
    return base.as_strided(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _widen_dtypes(value, dtype):
    if isinstance(value, list):
        return [_widen_dtypes(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _widen_dtypes(v, dtype) for k, v in value.items()}
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return dtype
    return value


def errors(expected: list, got: list) -> tuple[float, int]:
    """(worst rel_l2 over the floating outputs' finite positions, elements whose NaN/Inf or integer value differ)."""
    worst, mismatch = 0.0, 0
    for want, have in zip(expected, got, strict=True):
        a, b = want.double().reshape(-1), have.double().reshape(-1)
        if not (want.is_floating_point() and have.is_floating_point()):
            mismatch += int((a != b).sum())
            continue
        finite = torch.isfinite(a) & torch.isfinite(b)
        mismatch += int((~finite & ~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum())
        norm, diff = float(a[finite].norm()), float((a[finite] - b[finite]).norm())
        worst = max(worst, diff / norm if norm else (0.0 if diff == 0 else math.inf))
    return worst, mismatch


def diopi_check(expected: list, got: list, atol: float, rtol: float) -> tuple[bool, int, int]:
    """DIOPI's rule: np.isclose(got, expected, rtol, atol) fails on at most `MISMATCH_RATIO` of the elements."""
    off = total = 0
    for want, have in zip(expected, got, strict=True):
        close = np.isclose(have.double().numpy(), want.double().numpy(), rtol=rtol, atol=atol, equal_nan=True)
        off, total = off + int(close.size - close.sum()), total + int(close.size)
    return off <= MISMATCH_RATIO * max(total, 1), off, total


def read_case(path: Path) -> tuple[dict, dict, list, list]:
    """(attrs with `args`/`kwargs` decoded from JSON, inputs by name, expected outputs, target outputs)."""
    with h5py.File(path, "r") as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        if attrs.get("format") != FORMAT or int(attrs.get("version", 0)) != VERSION:
            raise ValueError(f"{path} is not a {FORMAT} version {VERSION} file")
        tensors = {name: read_tensor(dset) for name, dset in f[INPUTS].items()}
        outputs = [[from_storage(g[k][()], str(g[k].attrs["dtype"])).reshape([int(s) for s in g[k].attrs["shape"]])
                    for k in sorted(g, key=int)] for g in (f[OUTPUTS], f[TARGET_OUTPUTS])]
    call = json.loads(attrs["args"])
    attrs["args"], attrs["kwargs"] = call["args"], call["kwargs"]
    return attrs, tensors, outputs[0], outputs[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="where to run the op (default: the device oneiter traced it on)")
    parser.add_argument("--plugin", action="append", default=[], help="a module to import first (a vendor plugin)")
    parser.add_argument("--case", type=Path, default=Path(__file__).with_name(CASE), help="the case file")
    options = parser.parse_args(argv)
    try:
        case, tensors, stored, _ = read_case(options.case)
        device = torch.device(options.device or case["device"])
        plugins = json.loads(case.get("plugins") or "{}")  # device type -> vendor plugin (oneiter's device table)
        for module in [*options.plugin, *([plugins[device.type]] if device.type in plugins else [])]:
            importlib.import_module(module)
        op = the_op(case)
        got = run(op, case, tensors, device)
    except Exception as exc:  # noqa: BLE001 - a case that cannot run here: say why in one line
        print(f"error: the case cannot run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return report(case, op, tensors, stored, got, device)


def report(case: dict, op, tensors: dict, stored: list, got: list, device) -> int:
    """Print the errors and the verdict; the exit code (0 within noise, 1 not)."""
    try:
        expected, how = run(op, case, tensors, "cpu", torch.float64), "the op in float64 on the CPU"
    except Exception:  # noqa: BLE001 - no float64 kernel: the expected outputs oneiter stored
        expected, how = stored, f"stored in the case ({case['reference']})"
    error, mismatch = errors(expected, got)
    noise, factor = float(case["expected_noise"]), float(case["factor"])
    wrong = error > factor * noise or mismatch > 0
    passed, off, total = diopi_check(expected, got, float(case["atol"]), float(case["rtol"]))
    lines = [f"{case['op']} ({case['phase']}) called at {case['line']}", f"  reference           {how}",
             f"  error on {str(device):10s} rel_l2 {error:.3e}" + (f", {mismatch} elements whose NaN/Inf or integer "
                                                                    "values differ" if mismatch else "")]
    same = " (the same run: --device is the CPU)" if torch.device(device).type == "cpu" else ""
    lines.append(f"  error on cpu        rel_l2 {_cpu_error(op, case, tensors, expected)} (the CPU kernel in the op's "
                 f"own dtypes){same}")
    lines += [f"  expected noise      rel_l2 {noise:.3e} (its precision on a correct kernel; flagged above "
              f"{factor:g}x)",
              f"  when traced         rel_l2 {float(case['error']):.3e} on {case['device']} ({case['layer']})",
              f"  DIOPI-style check   isclose(atol {float(case['atol']):.2e}, rtol {float(case['rtol']):.2e}): {off} "
              f"of {total} elements outside (at most {MISMATCH_RATIO:.1%} may be): {'pass' if passed else 'fail'}",
              f"{'WRONG' if wrong else 'OK'}: the op's error on {device} is "
              f"{error / noise if noise else math.inf:.1f}x its expected noise"]
    print("\n".join(lines))
    return 1 if wrong else 0


def _cpu_error(op, case: dict, tensors: dict, expected: list) -> str:
    try:
        return f"{errors(expected, run(op, case, tensors, 'cpu'))[0]:.3e}"
    except Exception as exc:  # noqa: BLE001 - the CPU has no kernel for these dtypes
        return f"not run ({type(exc).__name__})"


if __name__ == "__main__":
    sys.exit(main())
