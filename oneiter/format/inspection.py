"""What a recording holds, tensor by tensor: the library side of `oneiter inspect`.

Sits below the comparison engine (format never imports judge): it reads a file through
`oneiter.format.layout.IterationFile` (batch, loss, every entry, the state before the iteration) one tensor at a
time and reduces each to float64 statistics over its finite elements (min, max, mean, std) plus NaN/Inf counts.
The CLI (`oneiter.cli.inspect_cmd`) only renders the result.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import numpy as np

from oneiter.format.layout import IterationFile, reading
from oneiter.format.numbers import CHUNK, dot, flat_numbers
from oneiter.format.schema import LOSS, ROOT_MODULE, STATE_BEFORE, UNREDUCED_GRADS, collective_group

__all__ = ["TensorSummary", "tensor_stats", "summarize_file", "FileSummary"]


@dataclass
class TensorSummary:
    """One tensor of a file; statistics are over finite elements (None when there are none)."""

    module: str
    call: int
    phase: str
    tensor: str
    shape: tuple
    dtype: str
    num_elements: int
    min: Optional[float]
    max: Optional[float]
    mean: Optional[float]
    std: Optional[float]
    num_nan: int
    num_inf: int

    @property
    def name(self) -> str:
        return f"{self.module}@{self.call} {self.phase} {self.tensor}"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data


@dataclass
class FileSummary:
    """A file's metadata and its tensors, in file order (batch, loss, forward/backward per call, params, state)."""

    path: str
    meta: dict[str, Any]
    num_calls: int
    tensors: list[TensorSummary]


def tensor_stats(array: np.ndarray, chunk: int = CHUNK) -> dict[str, Any]:
    """min, max, mean, std (population) over the finite elements, in float64; NaN and Inf counts.

    Chunks are merged with Chan's pairwise formula, so the std stays exact when the mean is large.
    """
    flat = flat_numbers(array)
    count, mean, m2, num_nan, num_inf = 0, 0.0, 0.0, 0, 0
    low, high = math.inf, -math.inf
    buffer = np.empty(min(chunk, max(flat.size, 1)), dtype=np.float64)
    for start in range(0, flat.size, chunk):
        part = buffer[: min(chunk, flat.size - start)]
        np.copyto(part, flat[start:start + chunk])
        part_sum = float(part.sum())
        if not math.isfinite(part_sum):  # NaN/Inf in this chunk (or an overflowing sum): keep finite values only
            finite = np.isfinite(part)
            nan = int(np.count_nonzero(np.isnan(part)))
            num_nan += nan
            num_inf += int(part.size - np.count_nonzero(finite)) - nan
            part = part[finite]
            part_sum = float(part.sum())
        if not part.size:
            continue
        n = part.size
        part_mean = part_sum / n
        low, high = min(low, float(part.min())), max(high, float(part.max()))
        np.subtract(part, part_mean, out=part)
        part_m2 = dot(part, part)
        delta = part_mean - mean
        total = count + n
        mean += delta * n / total
        m2 += part_m2 + delta * delta * count * n / total
        count = total
    if count == 0:
        return {"min": None, "max": None, "mean": None, "std": None, "num_nan": num_nan, "num_inf": num_inf}
    return {"min": low, "max": high, "mean": mean, "std": math.sqrt(m2 / count), "num_nan": num_nan,
            "num_inf": num_inf}


def _from_stats(stats) -> dict[str, Any]:
    """The same figures from a `--level stats` entry (std from the L2 norm and the mean of the finite values)."""
    finite = stats["numel"] - stats["nan"] - stats["inf"]
    if finite <= 0:
        return {"min": None, "max": None, "mean": None, "std": None, "num_nan": int(stats["nan"]),
                "num_inf": int(stats["inf"])}
    var = max(stats["l2"] ** 2 / finite - stats["mean"] ** 2, 0.0)
    return {"min": stats["min"], "max": stats["max"], "mean": stats["mean"], "std": math.sqrt(var),
            "num_nan": int(stats["nan"]), "num_inf": int(stats["inf"])}


def _locations(f: IterationFile) -> Iterator[tuple[str, int, str, str, str]]:
    """(module, call, phase, tensor, dataset path) for everything the file holds."""
    for path in f.batch_paths():
        yield ROOT_MODULE, 0, "batch", path.rpartition("/")[2], path
    if f.has(LOSS):
        yield ROOT_MODULE, 0, "loss", "loss", LOSS
    for e in f.entries():
        yield e.module, e.call, e.phase, e.tensor, e.path
    for name, path in f.state(STATE_BEFORE).items():
        module, _, tensor = name.rpartition(".")
        yield module or ROOT_MODULE, 0, "state_before", tensor, path
    for name, path in f.state(UNREDUCED_GRADS).items():
        module, _, tensor = name.rpartition(".")
        yield module or ROOT_MODULE, 0, "param_grad_unreduced", tensor, path
    for name, attrs in f.collectives():  # `all_reduce@3 collective output.0`: this rank's collective number 3
        group = collective_group(int(name))
        for tensor in f.names_in(group):
            yield str(attrs["op"]), int(name), "collective", tensor, f"{group}/{tensor}"


def summarize_file(path: str | os.PathLike) -> FileSummary:
    """Statistics of every tensor in a recording, reading one tensor at a time (hard links read once). A multi-step
    recording lists every step's, each phase named with its step (`forward (step 6)`)."""
    with reading(path), IterationFile(path) as f:
        tensors = []
        steps: list[int | None] = [*f.steps()] or [None]
        for step in steps:
            one = f if step is None else f.step(step)
            tensors += _summaries(one, "" if step is None else f" (step {step})")
        num_calls = len(f.calls()) if not f.steps() else len(f.step(f.steps()[0]).calls())
        return FileSummary(str(f.path), dict(f.meta), num_calls, tensors)


def _summaries(f: IterationFile, suffix: str) -> list[TensorSummary]:
    tensors, seen = [], {}
    for module, call, phase, tensor, dpath in _locations(f):
        key = f.dataset_id(dpath)
        if key not in seen:
            seen[key] = _from_stats(f.stats_of(dpath)) if f.is_stats(dpath) else tensor_stats(f.read(dpath))
        shape = f.shape_of(dpath)
        tensors.append(TensorSummary(module, call, phase + suffix, tensor, shape, f.dtype_of(dpath),
                                     int(np.prod(shape, dtype=np.int64)), **seen[key]))
    return tensors
