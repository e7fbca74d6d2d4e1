"""`oneiter replay --ops --repro DIR`: the culprit op as a case a vendor can run without oneiter.

Where this sits: `ops.OpTracer` keeps the first flagged op as an `OpCase` (its callable, its inputs as they were
before it ran with the strides and storage offsets it was given, what the target produced, what the CPU rerun
gave); `write_repro` writes DIR/case.h5 (HDF5, no pickle) and DIR/repro.py, a copy of `format/op_case.py`, which
holds the layout's names and runs the case with torch, h5py and numpy only. Both files are written through
`oneiter.outputs` (the folder resolved, each file whole or not at all); a folder that already holds either is
refused, never overwritten.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from oneiter.errors import OneIterError
from oneiter.format import op_case
from oneiter.outputs import OutputError, atomic_path, atomic_text, file_in, resolve_folder
from oneiter.record.local.rerun import with_layout
from oneiter.record.replay.op_rerun import OpCase
from oneiter.runtime.devices import plugins

__all__ = ["repro_folder", "write_repro", "case_tolerances"]


def repro_folder(given: str | Path) -> Path:
    """The `--repro` folder, checked before anything runs: a folder (or a new name) that holds no repro.py or
    case.h5 yet."""
    folder = resolve_folder(given, "--repro")
    for name in (op_case.SCRIPT, op_case.CASE):
        path = file_in(folder, name, "--repro")
        if path.exists():
            raise OutputError(f"--repro '{given}': '{path}' already exists: choose another folder (it is never "
                              "overwritten)")
    return folder


def case_tolerances(case: OpCase, noise: float, factor: float) -> tuple[float, float]:
    """(atol, rtol) of the DIOPI-style check: rtol `factor` x the expected noise; atol the same relative to the
    expected outputs' RMS (a kernel within noise passes; one off by more than the noise allows does not)."""
    rtol = factor * noise
    squares = count = 0.0
    for out in case.expected:
        if out.is_floating_point() and out.numel():
            values = out.double()
            values = values[torch.isfinite(values)]
            squares, count = squares + float(values.square().sum()), count + values.numel()
    rms = math.sqrt(squares / count) if count else 0.0
    return rtol * rms, rtol


def write_repro(folder: Path, case: OpCase, *, noise: float, factor: float, meta: dict[str, Any]) -> list[Path]:
    """Write DIR/case.h5 and DIR/repro.py for `case` (judged against `noise` x `factor`); `meta`: the device it was
    traced on, the layer call, the recording. Returns the two paths."""
    folder = repro_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    func = case.func
    names = _argument_names(func, len(case.args))
    tensors: dict[str, torch.Tensor] = {}
    encoded = {"args": [_encode(v, n, tensors) for v, n in zip(case.args, names, strict=True)],
               "kwargs": {k: _encode(v, k, tensors) for k, v in case.kwargs.items()}}
    atol, rtol = case_tolerances(case, noise, factor)
    row = case.row
    attrs = {
        "format": op_case.FORMAT, "version": op_case.VERSION, "op": row.op, "namespace": func.namespace,
        "name": func.overloadpacket.__name__, "overload": func._overloadname, "phase": row.phase, "line": row.line,
        "node": row.node, "args": json.dumps(encoded), "expected_noise": noise, "factor": factor,
        "error": row.rel_l2, "reference": row.reference, "atol": atol, "rtol": rtol,
        "mismatch_ratio_threshold": op_case.MISMATCH_RATIO, "plugins": json.dumps(plugins()),
        **{k: str(v) for k, v in meta.items()},
    }
    data, script = file_in(folder, op_case.CASE, "--repro"), file_in(folder, op_case.SCRIPT, "--repro")
    with atomic_path(data) as tmp:
        _write_case(tmp, attrs, {n: (t, case.layouts[id(t)]) for n, t in tensors.items()}, case)
    with atomic_text(script) as fh:
        fh.write(Path(op_case.__file__).read_text(encoding="utf-8"))
    return [script, data]


def _argument_names(func, num_positional: int) -> list[str]:
    arguments = func._schema.arguments
    return [arguments[i].name if i < len(arguments) else f"arg{i}" for i in range(num_positional)]


def _encode(value, name: str, tensors: dict):
    """One argument as JSON (`op_case.decode` reads it back); its tensors go into `tensors` under their names."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {"tensor": name}
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": True}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise OneIterError(f"cannot write a reproducer: the op's argument '{name}' is a {type(value).__name__}, which "
                       "a case file cannot hold")


def _write_case(path: Path, attrs: dict, inputs: dict, case: OpCase) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        f.attrs.update({k: ("" if v is None else v) for k, v in attrs.items()})
        group = f.create_group(op_case.INPUTS)
        for name, (tensor, (stride, offset)) in inputs.items():
            laid = with_layout(tensor, (tuple(stride), offset))
            extent = offset + 1 + sum((n - 1) * s for n, s in zip(tensor.shape, stride, strict=True)) \
                if tensor.numel() else 0
            storage = laid.as_strided((extent,), (1,), 0) if extent else tensor.reshape(-1)
            array, dtype = op_case.to_storage(storage)
            dset = group.create_dataset(name, data=array)
            dset.attrs.update({"dtype": dtype, "shape": list(tensor.shape), "stride": list(stride),
                               "storage_offset": int(offset)})
        for group_name, values in ((op_case.OUTPUTS, case.expected), (op_case.TARGET_OUTPUTS, case.produced)):
            group = f.create_group(group_name)
            for i, value in enumerate(values):
                array, dtype = op_case.to_storage(value)
                group.create_dataset(str(i), data=array).attrs.update({"dtype": dtype, "shape": list(value.shape)})
