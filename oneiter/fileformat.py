"""The one place that knows the HDF5 layout of a oneiter recording (documented in docs/format.md).

Writers (the recorder's background thread) and readers (compare, inspect, replay) both go through this module;
nothing else builds HDF5 paths. No pickle anywhere: tensors are plain datasets, metadata plain attributes.

Layout, schema `oneiter.iteration` version 1::

    /                          attrs: schema, schema_version, complete (written last), model, device, ...
    /batch/input.<i>           the model inputs
    /loss                      the loss (0-d)
    /calls/<module>@<call>     one group per module call; attrs module, call, exec_index, class_name, seq_*
        forward/input.<i>, forward/kwarg.<name>, forward/output[.<i>|.<key>]...
        backward/grad_output..., backward/grad_input.<i>
        local/forward/output..., local/backward/grad_input.<i>   per-layer local results (leaf modules),
                               attrs kind (teacher_forced | against_cpu), noise.<tensor>, skipped
    /state_before/<name>       every parameter and buffer before the iteration
    /param_grads/<name>        every parameter gradient after backward
    /state_after/<name>        every parameter and buffer after the optimizer step
    /random/<index>            values of each random op, in order (attrs op, index, output)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import FormatError

__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "ROOT_MODULE", "call_key", "split_call_key", "decode",
    "FileWriter", "IterationFile", "Entry", "to_torch", "tensor_to_numpy", "seq_kind",
]

SCHEMA = "oneiter.iteration"
SCHEMA_VERSION = 1
ROOT_MODULE = "(root)"  # how the model itself (module path "") is named in files and reports

BATCH, LOSS, CALLS = "batch", "loss", "calls"
STATE_BEFORE, PARAM_GRADS, STATE_AFTER = "state_before", "param_grads", "state_after"
RANDOM = "random"  # values of random ops (dropout masks, randn...), recorded on the reference, replayed on targets
FORWARD, BACKWARD, LOCAL = "forward", "backward", "local"

# torch dtypes HDF5 has no type for: stored as raw bits of this numpy type, with the dtype name in attrs
_RAW_BITS = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "float8_e4m3fnuz": np.uint8, "float8_e5m2fnuz": np.uint8,
}


def call_key(module: str, call: int) -> str:
    """`layer1.0.conv1@0`: the group name of a module call, and the key reports use."""
    return f"{module or ROOT_MODULE}@{call}"


def split_call_key(key: str) -> tuple[str, int]:
    module, _, call = key.rpartition("@")
    return module, int(call)


def decode(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """A stored array as numbers numpy can compute with: bfloat16 bits become float32 (exactly)."""
    if dtype_name == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if dtype_name in _RAW_BITS:  # float8: decoding needs torch's tables
        return to_torch(array, dtype_name).float().numpy()
    return array


def to_torch(array: np.ndarray, dtype_name: str):
    """A stored array as a torch tensor with its original dtype, bit for bit."""
    import torch

    array = np.asarray(array)
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    if dtype_name in _RAW_BITS:
        signed = {np.uint16: torch.int16, np.uint8: torch.uint8}[_RAW_BITS[dtype_name]]
        tensor = tensor.view(signed).view(getattr(torch, dtype_name))
    return tensor


def tensor_to_numpy(tensor) -> tuple[np.ndarray, str]:
    """A CPU tensor as (numpy array to store, torch dtype name). Shares memory where it can."""
    import torch

    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if dtype_name in _RAW_BITS:
        bits = torch.int16 if _RAW_BITS[dtype_name] is np.uint16 else torch.uint8
        return tensor.view(bits).numpy().view(_RAW_BITS[dtype_name]), dtype_name
    return tensor.numpy(), dtype_name


class FileWriter:
    """Writes one recording; used from a single (the writer) thread. Complete only after `finish`."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        import h5py

        self.path = Path(path)
        self.file = h5py.File(self.path, "w", libver="latest")
        self.file.attrs.update(_clean_attrs({**meta, "schema": SCHEMA, "schema_version": SCHEMA_VERSION}))
        self.file.attrs["complete"] = False
        self.num_datasets = 0
        self.num_bytes = 0

    def write(self, group: str, name: str, array: np.ndarray, dtype_name: str, attrs: dict | None = None) -> str:
        grp = self.file.require_group(group) if group else self.file
        dset = grp.create_dataset(name, data=array)
        dset.attrs["dtype"] = dtype_name
        if attrs:
            dset.attrs.update(_clean_attrs(attrs))
        self.num_datasets += 1
        self.num_bytes += array.nbytes
        return f"{group}/{name}"

    def link(self, group: str, name: str, target: str) -> None:
        """A hard link: the same tensor captured twice (a layer's output is the next layer's input) is stored once."""
        (self.file.require_group(group) if group else self.file)[name] = self.file[target]
        self.num_datasets += 1

    def set_attrs(self, path: str, attrs: dict[str, Any]) -> None:
        self.file.require_group(path).attrs.update(_clean_attrs(attrs))

    def finish(self, attrs: dict[str, Any]) -> None:
        self.file.attrs.update(_clean_attrs(attrs))
        self.file.attrs["complete"] = True
        self.file.close()

    def abort(self) -> None:
        try:
            self.file.close()
        except Exception:
            pass


def _clean_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """HDF5 attributes: None becomes an empty string, lists of strings variable-length string arrays."""
    import h5py

    out = {}
    for key, value in attrs.items():
        if value is None:
            value = ""
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            value = np.array(value, dtype=h5py.string_dtype())
        elif isinstance(value, np.str_):
            value = str(value)
        out[key] = value
    return out


@dataclass(frozen=True)
class Entry:
    """One recorded tensor, as compare sees it. `phase`: forward, backward, param_grad, optimizer, batch, loss."""

    module: str
    call: int
    phase: str
    tensor: str
    path: str
    seq: int  # capture order inside its phase (forward/backward); parameter order otherwise

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.module, self.call, self.phase, self.tensor)


class IterationFile:
    """A read-only, validated oneiter recording. Use as a context manager or call `close()`."""

    def __init__(self, path: str | os.PathLike):
        import h5py

        self.path = Path(path)
        if not self.path.exists():
            raise FormatError(f"'{self.path}' does not exist")
        if self.path.is_dir():
            raise FormatError(f"'{self.path}' is a directory, expected a .h5 file written by `oneiter record`")
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as exc:
            if not h5py.is_hdf5(self.path):
                raise FormatError(f"'{self.path}' is not an HDF5 file") from None
            raise FormatError(f"'{self.path}' cannot be read: truncated or corrupt HDF5 ({_first_line(exc)})") from None
        self.meta = {k: _plain(v) for k, v in self.file.attrs.items()}
        self._validate()

    def _validate(self) -> None:
        if self.meta.get("schema") != SCHEMA:
            self.close()
            raise FormatError(f"'{self.path}' is an HDF5 file but not a oneiter recording (schema attribute missing)")
        if int(self.meta.get("schema_version", 0)) > SCHEMA_VERSION:
            self.close()
            raise FormatError(
                f"'{self.path}' has schema version {self.meta['schema_version']}, this oneiter reads up to "
                f"{SCHEMA_VERSION}: upgrade oneiter"
            )
        if not self.meta.get("complete"):
            self.close()
            raise FormatError(f"'{self.path}' is incomplete: the run that wrote it did not finish")

    def __enter__(self) -> "IterationFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.file.close()
        except Exception:
            pass

    # -- reading tensors --------------------------------------------------------------------------------------------
    def dtype_of(self, path: str) -> str:
        return _plain(self.file[path].attrs["dtype"])

    def shape_of(self, path: str) -> tuple[int, ...]:
        return tuple(self.file[path].shape)

    def raw(self, path: str) -> np.ndarray:
        """The stored array (bfloat16 as raw uint16 bits)."""
        dset = self.file[path]
        return dset[()] if dset.shape == () else dset[...]

    def read(self, path: str) -> np.ndarray:
        """The tensor as numbers numpy can compute with (bfloat16 decoded to float32, exactly)."""
        try:
            return np.asarray(decode(self.raw(path), self.dtype_of(path)))
        except (OSError, KeyError) as exc:
            raise FormatError(f"'{self.path}': cannot read '{path}' ({_first_line(exc)}); the file may be truncated") from None

    def tensor(self, path: str):
        """The tensor as a torch tensor with its original dtype, bit for bit."""
        return to_torch(self.raw(path), self.dtype_of(path))

    def has(self, path: str) -> bool:
        return path in self.file

    def attrs(self, path: str) -> dict[str, Any]:
        """The attributes of a group or dataset, as plain Python values ({} if it does not exist)."""
        obj = self.file.get(path)
        return {} if obj is None else {k: _plain(v) for k, v in obj.attrs.items()}

    def local_kind(self) -> str:
        """`teacher_forced`, `against_cpu`, or "" when the file holds no per-layer local results."""
        return str(self.meta.get("local", "") or "")

    # -- structure --------------------------------------------------------------------------------------------------
    def state(self, which: str = STATE_BEFORE) -> dict[str, str]:
        """Parameter/buffer name -> dataset path, in recorded order."""
        return self._named(which)

    def batch_paths(self) -> list[str]:
        group = self.file.get(BATCH)
        if group is None:
            return []
        names = sorted(group.keys(), key=lambda n: int(n.rpartition(".")[2]))
        return [f"{BATCH}/{n}" for n in names]

    def _named(self, group_name: str) -> dict[str, str]:
        group = self.file.get(group_name)
        if group is None:
            return {}
        order = list(group.attrs.get("order", [])) or sorted(group.keys())
        return {str(n): f"{group_name}/{n}" for n in order}

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        """(call key, attrs) in execution order."""
        group = self.file.get(CALLS)
        if group is None:
            return []
        items = [(k, {a: _plain(v) for a, v in group[k].attrs.items()}) for k in group.keys()]
        return sorted(items, key=lambda kv: kv[1].get("exec_index", 0))

    def entries(self, *, local: bool = False) -> Iterator[Entry]:
        """Every recorded tensor of the iteration (forward, backward, param_grad, optimizer) as an Entry.

        With `local=True`, the per-layer local results instead (`calls/<key>/local/...` of leaf modules).
        """
        for key, attrs in self.calls():
            module, call = attrs["module"] or ROOT_MODULE, int(attrs["call"])
            base = f"{CALLS}/{key}/{LOCAL}" if local else f"{CALLS}/{key}"
            for phase in (FORWARD, BACKWARD):
                grp = self.file.get(f"{base}/{phase}")
                if grp is None:
                    continue
                for name in grp.keys():
                    seq = int(attrs.get(f"seq_{seq_kind(name)}", 0))
                    yield Entry(module, call, phase, name, f"{base}/{phase}/{name}", seq)
        if local:
            return
        for phase, group_name in (("param_grad", PARAM_GRADS), ("optimizer", STATE_AFTER)):
            for i, (name, path) in enumerate(self._named(group_name).items()):
                module, _, tensor = name.rpartition(".")
                yield Entry(module or ROOT_MODULE, 0, phase, tensor, path, i)


def seq_kind(tensor_name: str) -> str:
    """Which capture moment a tensor name belongs to: input, output, grad_output or grad_input.

    Capture order is kept per call group (attrs `seq_input`, `seq_output`, `seq_grad_output`, `seq_grad_input`),
    not per dataset, because a dataset hard-linked from two calls has one set of attributes.
    """
    head = tensor_name.split(".", 1)[0]
    return "input" if head == "kwarg" else head


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
