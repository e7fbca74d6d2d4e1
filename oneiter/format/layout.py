"""The one place that knows the HDF5 layout of a oneiter recording (documented in docs/format.md).

Writers (the recorder's background thread) and readers (compare, inspect, replay) both go through this module;
nothing else builds HDF5 paths. No pickle anywhere: tensors are plain datasets, metadata plain attributes.

Layout, schema `oneiter.iteration` version 2::

    /                          attrs: schema, schema_version, complete (written last), model, device, ...
    /batch/input.<i>           the model inputs
    /loss                      the loss (0-d)
    /calls/<module>@<call>     one group per module call; attrs module, call, parent, exec_index, class_name, seq_*
        forward/input.<i>[...], forward/kwarg.<name>[...], forward/output[.<i>|.<key>]...
        backward/grad_output..., backward/grad_input.<i>..., backward/grad_kwarg.<name>...
    /local                     one row per locally judged tensor (a table; `record --replay` / `--against cpu`)
    /unprobed                  the calls that could not be rerun, and why (a table)
    /state_before/<name>       every parameter and buffer before the iteration
    /param_grads/<name>        every parameter gradient after backward
    /state_after/<name>        every parameter and buffer after the optimizer step
    /random/<index>            values of each random op, in order (attrs op, index, output)

Tensor names inside a call: `input.<i>` (positional arguments, nested: `input.1.0`), `kwarg.<name>` (keyword
arguments), `output` / `output.<i>` / `output.<key>`; the gradient w.r.t. a tensor named X is `grad_X`. In the
local table a container's own code is judged on what it hands its children: `<child call>:input.0` (forward)
and `<child call>:grad_output` (backward), e.g. `layer1.0.conv2@0:input.0`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from oneiter.errors import FormatError

__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "ROOT_MODULE", "call_key", "split_call_key", "decode", "tensor_path", "grad_name",
    "FileWriter", "IterationFile", "Entry", "to_torch", "tensor_to_numpy", "seq_kind", "LOCAL_FIELDS", "LocalRow",
    "child_tensor", "split_child_tensor",
]

SCHEMA = "oneiter.iteration"
SCHEMA_VERSION = 3  # 3: `level` and the `/stats` table (record --level stats)
ROOT_MODULE = "(root)"  # how the model itself (module path "") is named in files and reports

BATCH, LOSS, CALLS = "batch", "loss", "calls"
STATE_BEFORE, PARAM_GRADS, STATE_AFTER = "state_before", "param_grads", "state_after"
RANDOM = "random"  # values of random ops (dropout masks, randn...), recorded on the reference, replayed on targets
FORWARD, BACKWARD, LOCAL, UNPROBED = "forward", "backward", "local", "unprobed"
STATS = "stats"  # `--level stats`: one table row per entry (path, statistics, checksum), no per-entry dataset

# torch dtypes HDF5 has no type for: stored as raw bits of this numpy type, with the dtype name in attrs
_RAW_BITS = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "float8_e4m3fnuz": np.uint8, "float8_e5m2fnuz": np.uint8,
}


def check_name(name: str, what: str) -> None:
    """Refuse, at record time, a module path or tensor name holding '/': HDF5 would read it as nested groups and
    the recording could not be read back (a ModuleDict key or a dict output key such as 'a/b')."""
    if "/" in name:
        from oneiter.errors import OneIterError

        raise OneIterError(f"cannot record {what} '{name}': it contains '/', which HDF5 reads as a group separator; "
                           f"rename the ModuleDict or dict key")


def call_key(module: str, call: int) -> str:
    """`layer1.0.conv1@0`: the group name of a module call, and the key reports use."""
    return f"{module or ROOT_MODULE}@{call}"


def split_call_key(key: str) -> tuple[str, int]:
    module, _, call = key.rpartition("@")
    return module, int(call)


def tensor_path(key: str, phase: str, name: str) -> str:
    """`calls/layer1.0.conv1@0/forward/input.0`: where a call's tensor lives."""
    return f"{CALLS}/{key}/{phase}/{name}"


def grad_name(name: str) -> str:
    """The name of the gradient w.r.t. tensor `name`: `output` -> `grad_output`, `kwarg.x` -> `grad_kwarg.x`."""
    return f"grad_{name}"


def child_tensor(child_key: str, name: str) -> str:
    """How the local table names a tensor a container hands its child: `layer1.0.conv2@0:input.0`."""
    return f"{child_key}:{name}"


def split_child_tensor(tensor: str) -> tuple[str, str] | None:
    """(child call key, tensor name) for a `child_tensor` name, None for a call's own tensor."""
    head, sep, name = tensor.rpartition(":")
    return (head, name) if sep and "@" in head else None


def group_path(group: str, name: str) -> str:
    """`state_before/layer1.0.conv1.weight`, `batch/input.0`: a named tensor of a top-level group."""
    return f"{group}/{name}" if group else name


def call_path(key: str, phase: str | None = None) -> str:
    """`calls/<key>` (its attributes) or `calls/<key>/<phase>` (its tensors of one phase)."""
    return f"{CALLS}/{key}" if phase is None else f"{CALLS}/{key}/{phase}"


# -- the tensor-name grammar ----------------------------------------------------------------------------------------
# A call's tensors: positional arguments `input.<i>`, keyword arguments `kwarg.<name>`, outputs `output` (one
# tensor) or `output.<i>`/`output.<key>` (nested containers add `.<index>`/`.<key>`), gradients `grad_<name>`.
def arg_name(index: int) -> str:
    return f"input.{index}"


def kwarg_name(key: str) -> str:
    return f"kwarg.{key}"


def is_input(tensor: str) -> bool:
    """Inputs of a call: forward inputs/kwargs, and in backward the gradients w.r.t. its outputs."""
    return tensor.startswith(("input", "kwarg", "grad_output"))


def natural_key(name: str) -> tuple:
    """Sort key of tensor names: `input.10` after `input.2`, `output.2` before `output.10`."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


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
    """Writes one recording; used from a single (the writer) thread. Complete only after `finish`.

    Per dataset HDF5 costs more than the bytes of a small tensor (~140 us through h5py's high-level API), so the
    hot path keeps its groups open, creates datasets and their `dtype` attribute with the low-level API from cached
    property lists and types, and makes hard links by path without opening the target."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        import h5py

        self.path = Path(path)
        self.file = h5py.File(self.path, "w", libver="latest")
        self.file.attrs.update(_clean_attrs({**meta, "schema": SCHEMA, "schema_version": SCHEMA_VERSION}))
        self.file.attrs["complete"] = False
        self._stats: dict[str, tuple] = {}  # path -> (Stats, dtype name, shape), until finish
        self._groups: dict[str, Any] = {"": self.file}  # open groups by path
        self._types: dict[np.dtype, Any] = {}  # numpy dtype -> HDF5 type id
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)  # contiguous, allocated at once, never filled
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # as h5py's create_dataset: no timestamps, identical files
        self._dcpl = dcpl
        self._str_type = h5py.h5t.py_create(h5py.string_dtype("utf-8"), logical=True)
        self._scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        self.num_datasets = 0
        self.num_bytes = 0

    def _group(self, path: str):
        """The group at `path` (created with its parents if needed), kept open."""
        grp = self._groups.get(path)
        if grp is None:
            grp = self._groups[path] = self.file.require_group(path)
        return grp

    def write(self, group: str, name: str, array: np.ndarray, dtype_name: str, attrs: dict | None = None) -> str:
        dset = self._group(group).create_dataset(name, data=array)
        self._describe(dset.id, array, dtype_name, attrs)
        return f"{group}/{name}"

    def reserve(self, group: str, name: str, array: np.ndarray, dtype_name: str, attrs: dict | None = None) -> int:
        """Create `group/name` for `array` with its storage allocated now and return the file offset of its bytes
        (the caller writes them there); -1 for an empty array (nothing to write)."""
        import h5py

        grp = self._group(group)
        if array.size == 0 or array.ndim == 0:  # HDF5 gives these no offset to write at: written here
            dsid = grp.create_dataset(name, data=array).id
            offset = -1
        else:
            tid = self._types.get(array.dtype)
            if tid is None:
                tid = self._types[array.dtype] = h5py.h5t.py_create(array.dtype)
            dsid = h5py.h5d.create(grp.id, name.encode(), tid, h5py.h5s.create_simple(array.shape), dcpl=self._dcpl)
            offset = dsid.get_offset()
        self._describe(dsid, array, dtype_name, attrs)
        return offset

    def _describe(self, dsid, array: np.ndarray, dtype_name: str, attrs: dict | None) -> None:
        """A new tensor dataset's attributes (its torch dtype, the caller's) and the writer's counts."""
        import h5py

        h5py.h5a.create(dsid, b"dtype", self._str_type, self._scalar).write(
            np.array(dtype_name, dtype=h5py.string_dtype()))
        if attrs:
            h5py.Dataset(dsid).attrs.update(_clean_attrs(attrs))
        self.num_datasets += 1
        self.num_bytes += array.nbytes

    def write_stats(self, group: str, name: str, stats, dtype_name: str, shape: tuple, attrs: dict | None) -> None:
        """A stats-level entry: a row of the `/stats` table (written by `finish`), no dataset of its own — a few
        hundred bytes per entry instead of an HDF5 object header each."""
        path = group_path(group, name)
        self._stats[path] = (stats, dtype_name, tuple(shape))
        self.num_datasets += 1
        self.num_bytes += stats.values.nbytes

    def link(self, group: str, name: str, target: str) -> None:
        """A hard link: the same tensor captured twice (a layer's output is the next layer's input) is stored once."""
        if target in self._stats:  # a stats entry: its row again, under the new name
            self._stats[group_path(group, name)] = self._stats[target]
        else:
            self._group(group).id.links.create_hard(name.encode(), self.file.id, target.encode())
        self.num_datasets += 1

    def set_attrs(self, path: str, attrs: dict[str, Any]) -> None:
        self._group(path).attrs.update(_clean_attrs(attrs))

    def local_table(self, rows: list[LocalRow], unprobed: list[tuple[str, int, str]], attrs: dict[str, Any]) -> None:
        """`/local` (one row per judged tensor) and `/unprobed` (module, call, reason), with the probe's attrs."""
        table = np.array([tuple(getattr(r, n) for n, _ in LOCAL_FIELDS) for r in rows],
                         dtype=_table_dtype(LOCAL_FIELDS))
        self.file.create_dataset(LOCAL, data=table).attrs.update(_clean_attrs(attrs))
        skipped = np.array(unprobed, dtype=_table_dtype(UNPROBED_FIELDS))
        self.file.create_dataset(UNPROBED, data=skipped)

    def finish(self, attrs: dict[str, Any]) -> None:
        if self._stats:
            from oneiter.format.stats import FIELDS

            rows = [(path, *stats.values, *stats.checksum, stats.kind, dtype, ",".join(map(str, shape)))
                    for path, (stats, dtype, shape) in self._stats.items()]
            self.file.create_dataset(STATS, data=np.array(rows, dtype=_table_dtype(_stats_fields(FIELDS))))
        self.file.attrs.update(_clean_attrs(attrs))
        self.file.attrs["complete"] = True
        self.file.close()

    def abort(self, empty_first: bool = False) -> None:
        """Close without marking the file complete. `empty_first` (after a write error): truncate the file to 0
        bytes before closing, so the metadata flush of close finds free blocks even on a full disk."""
        import os

        try:
            if empty_first:
                os.ftruncate(self.file.id.get_vfd_handle(), 0)
            self.file.close()
        except Exception:
            pass


UNPROBED_FIELDS = (("module", "str"), ("call", "i8"), ("reason", "str"))


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

        from oneiter.format import validate

        self.path = Path(path)
        validate.check_path(self.path)  # a FIFO or a device is refused before anything opens it
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as exc:
            if not h5py.is_hdf5(self.path):
                raise FormatError(f"'{self.path}' is not an HDF5 file") from None
            raise FormatError(f"'{self.path}' cannot be read: truncated or corrupt HDF5 ({_first_line(exc)})") from None
        from oneiter.format.mapped import MappedReader

        self._mapped = MappedReader(self.path)
        try:
            self.meta = validate.read_attrs(self.file, "the root group", self.path)
            self._validate()
        except BaseException:
            self.close()
            raise

    def _validate(self) -> None:
        """Everything a reader relies on, checked once here (`format/validate.py`, docs/format.md "Reading
        untrusted files"): root attributes, then every link and dataset of the file, then the /stats table."""
        from oneiter.format import validate

        validate.check_root_attrs(self.meta, self.path, SCHEMA_VERSION, SCHEMA)
        self._tree = validate.check_tree(self.file, self.path)
        try:
            self.stats_index
        except FormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged row
            raise FormatError(f"'{self.path}': the /{STATS} table cannot be read ({_first_line(exc)})") from None

    def __enter__(self) -> "IterationFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        mapped = getattr(self, "_mapped", None)
        if mapped is not None:
            mapped.close()
        try:
            self.file.close()
        except Exception:
            pass

    # -- reading tensors --------------------------------------------------------------------------------------------
    def dtype_of(self, path: str) -> str:
        if path in self.stats_index:
            return self.stats_index[path][1]
        stored = self._dataset(path)
        name = stored.name or stored.attrs.get("dtype")  # checked for every tensor; elsewhere as it is
        if not isinstance(name, str):
            raise FormatError(f"'{self.path}': '{path}' is not a tensor (no 'dtype' attribute)")
        return name

    def shape_of(self, path: str) -> tuple[int, ...]:
        if path in self.stats_index:
            return self.stats_index[path][2]
        return self._dataset(path).shape

    @property
    def stats_index(self) -> dict[str, tuple]:
        """path -> (Stats, dtype name, shape) of every stats-level entry (`/stats`); empty for a full recording."""
        if getattr(self, "_stats_index", None) is None:
            from oneiter.format.stats import FIELDS, Stats

            self._stats_index = {}
            table = self.file.get(STATS)
            if table is not None:
                for row in table[()]:
                    shape = tuple(int(s) for s in _plain(row["shape"]).split(",") if s)
                    if any(s < 0 for s in shape):
                        raise ValueError(f"negative dimension in shape '{_plain(row['shape'])}'")
                    stats = Stats([row[n] for n in FIELDS], (row["checksum0"], row["checksum1"]),
                                  _plain(row["checksum_kind"]))
                    self._stats_index[_plain(row["path"])] = (stats, _plain(row["dtype"]), shape)
        return self._stats_index

    def dataset_id(self, path: str):
        """Identity of what is stored at `path`: equal for two names hard-linked to one dataset."""
        return ("stats", path) if path in self.stats_index else self._dataset(path).addr

    def is_stats(self, path: str) -> bool:
        """A stats-level entry (`record --level stats`): statistics and a checksum, no tensor data."""
        return path in self.stats_index

    def stats_of(self, path: str):
        """The entry's `format.stats.Stats`: stored (stats level) or computed from its data (full level)."""
        from oneiter.format.stats import array_stats

        if path in self.stats_index:
            return self.stats_index[path][0]
        raw = self.raw(path)
        return array_stats(raw, decode(raw, self.dtype_of(path)))

    @property
    def level(self) -> str:
        """`full` (tensor data) or `stats` (statistics and checksums; batch and state_before of a reference in full)."""
        return str(self.meta.get("level") or "full")

    def raw(self, path: str) -> np.ndarray:
        """The stored array (bfloat16 as raw uint16 bits)."""
        if path in self.stats_index:
            raise FormatError(f"'{self.path}' holds only statistics for '{path}' (recorded with --level stats): "
                              f"this needs a full recording")
        stored = self._dataset(path)
        array = self._mapped.array(stored, f"'{self.path}': '{path}'")  # the page cache's pages, not a copy
        if array is not None:
            return array
        dset = self.file[path]
        return dset[()] if stored.shape == () else dset[...]

    def _dataset(self, path: str):
        """What the validation walk saw of the dataset at `path` (`validate.Stored`); missing: a FormatError."""
        stored = self._tree.datasets.get(path)
        if stored is None:
            raise FormatError(f"'{self.path}' holds no '{path}': the file is damaged")
        return stored

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
        # every link was seen by the validation walk: a dict lookup, not an HDF5 link traversal
        return path in self._tree.datasets or path in self.stats_index or path in self._tree.groups

    def attrs(self, path: str) -> dict[str, Any]:
        """The attributes of a group or dataset, as plain Python values ({} if it does not exist)."""
        if path in self._tree.datasets:
            return dict(self._tree.datasets[path].attrs)
        return dict(self._tree.groups[path][0]) if path in self._tree.groups else {}

    def local_kind(self) -> str:
        """`teacher_forced`, `against_cpu`, or "" when the file holds no per-layer local results."""
        return str(self.meta.get("local", "") or "")

    def local_rows(self) -> list[LocalRow]:
        """The rows of `/local` (empty without local data)."""
        table = self.file.get(LOCAL)
        if table is None:
            return []
        rows = []
        for rec in table[()]:
            values = {n: _plain(rec[n]) for n, _ in LOCAL_FIELDS}
            rows.append(LocalRow(**values))
        return rows

    def local_attrs(self) -> dict[str, Any]:
        return self.attrs(LOCAL)

    def unprobed(self) -> list[tuple[str, int, str]]:
        """(module, call, reason) of every call the local probe could not rerun."""
        table = self.file.get(UNPROBED)
        if table is None:
            return []
        return [(_plain(r["module"]), int(r["call"]), _plain(r["reason"])) for r in table[()]]

    # -- structure --------------------------------------------------------------------------------------------------
    def state(self, which: str = STATE_BEFORE) -> dict[str, str]:
        """Parameter/buffer name -> dataset path, in recorded order."""
        return self._named(which)

    def batch_paths(self) -> list[str]:
        names = sorted(self._names_in(BATCH), key=lambda n: int(n.rpartition(".")[2]))
        return [f"{BATCH}/{n}" for n in names]

    def _named(self, group_name: str) -> dict[str, str]:
        if group_name not in self._tree.groups:
            return {}
        order = list(self._tree.groups[group_name][0].get("order", [])) or self._names_in(group_name)
        return {str(n): f"{group_name}/{n}" for n in order}

    def _names_in(self, group_name: str) -> list[str]:
        """Entry names directly in a group: its datasets, and its rows of `/stats`."""
        names = list(self._tree.groups[group_name][1]) if group_name in self._tree.groups else []
        if self.stats_index:
            prefix = group_name + "/"
            names += [p[len(prefix):] for p in self.stats_index if p.startswith(prefix) and "/" not in p[len(prefix):]]
            names.sort()
        return names

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        """(call key, attrs) in execution order."""
        if getattr(self, "_calls", None) is None:  # read once: every reader walks the calls several times
            keys = self._tree.groups[CALLS][1] if CALLS in self._tree.groups else []
            items = [(k, self._tree.groups[f"{CALLS}/{k}"][0]) for k in keys]
            self._calls = sorted(items, key=lambda kv: kv[1].get("exec_index", 0))
        return [(key, dict(attrs)) for key, attrs in self._calls]

    def entries(self) -> Iterator[Entry]:
        """Every recorded tensor of the iteration (forward, backward, param_grad, optimizer) as an Entry."""
        for key, attrs in self.calls():
            module, call = attrs["module"] or ROOT_MODULE, int(attrs["call"])
            for phase in (FORWARD, BACKWARD):
                for name in self._names_in(call_path(key, phase)):
                    seq = int(attrs.get(f"seq_{seq_kind(name)}", 0))
                    yield Entry(module, call, phase, name, f"{CALLS}/{key}/{phase}/{name}", seq)
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
    return {"kwarg": "input", "grad_kwarg": "grad_input"}.get(head, head)


# -- the local table ------------------------------------------------------------------------------------------------
LOCAL_FIELDS = (
    ("module", "str"), ("call", "i8"), ("phase", "str"), ("tensor", "str"), ("seq", "i8"), ("dtype", "str"),
    ("numel", "i8"), ("rel_l2", "f8"), ("max_abs", "f8"), ("cosine", "f8"),
    ("nan_ref", "i8"), ("inf_ref", "i8"), ("nan", "i8"), ("inf", "i8"), ("mismatch", "i8"),
    ("noise_target", "f8"), ("noise_reference", "f8"), ("calibration", "str"),
)
"""Columns of `/local`. A row judges one tensor a call's own code produced, rerun on trustworthy inputs:
rel_l2/max_abs/cosine/NaN/Inf counts of the judged value against its reference (`_ref` columns: the reference
side), `mismatch` the positions where NaN/Inf differ (position and sign), `noise_target`/`noise_reference` the
calibrated expected rel-L2 error of the target's and the reference's precision (NaN: not calibrated, because
the error was already within one unit roundoff), `calibration` where that was measured (`cpu`, `device`)."""


@dataclass(frozen=True)
class LocalRow:
    module: str
    call: int
    phase: str
    tensor: str
    seq: int
    dtype: str
    numel: int
    rel_l2: float
    max_abs: float
    cosine: float
    nan_ref: int
    inf_ref: int
    nan: int
    inf: int
    mismatch: int
    noise_target: float
    noise_reference: float
    calibration: str

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.module, self.call, self.phase, self.tensor)


def _stats_fields(names) -> tuple:
    """Columns of `/stats`: the entry's path, `format.stats.FIELDS`, the checksum, its kind, dtype and shape."""
    return (("path", "str"), *((n, "f8") for n in names), ("checksum0", "i8"), ("checksum1", "i8"),
            ("checksum_kind", "str"), ("dtype", "str"), ("shape", "str"))


def _table_dtype(fields) -> np.dtype:
    import h5py

    return np.dtype([(n, h5py.string_dtype() if t == "str" else t) for n, t in fields])


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
