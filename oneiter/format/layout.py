"""The recording as a file: `IterationFile` opens, validates and reads one (`file_writer.py`'s `FileWriter` writes one).

What the file holds and how its tensors are named is `schema.py` (docs/format.md); what a reader refuses is
`validate.py`, which `IterationFile` runs before anything reads a file. Readers (compare, inspect, replay) go
through this module, writers (the recorder's background thread) through `file_writer.py`; nothing else opens a
recording.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from oneiter.errors import FormatError, OneIterError
from oneiter.format import consistency, validate
from oneiter.format.mapped import MappedReader
from oneiter.format.schema import (
    BACKWARD,
    BATCH,
    CALLS,
    COLLECTIVES,
    COMPILED,
    FORWARD,
    IMPACT,
    IMPACT_FIELDS,
    LOCAL,
    LOCAL_FIELDS,
    LOCAL_OPTIONAL,
    LOSS,
    MICROBATCH,
    MICROBATCH_LOSS,
    MICROBATCHES,
    OPTIMIZER,
    PARAM_GRADS,
    ROOT_MODULE,
    SCHEMA,
    SCHEMA_VERSION,
    SIGNATURE,
    STATE_AFTER,
    STATE_BEFORE,
    STATS,
    STEP_GRADS,
    STEP_START,
    STEPS,
    TWIN_SIGNATURE,
    UNPROBED,
    ImpactRow,
    LocalRow,
    call_path,
    decode,
    layout_from_attrs,
    plain,
    seq_kind,
    step_group,
    to_torch,
)
from oneiter.format.signature import Signature
from oneiter.format.stats import Stats, array_stats

__all__ = ["IterationFile", "Entry", "reading"]


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

    _owner = True  # False for a step's view of a multi-step recording: the file is its recording's
    _local_rows: list[LocalRow] | None = None  # `/local`, read once
    _calls: list[tuple[str, Any]] | None = None  # the call groups in execution order, read once
    _stats_index: dict[str, tuple]
    _stats_raw: dict[str, tuple]
    _pass_through: set[tuple[str, int]]

    def __init__(self, path: str | os.PathLike):
        import h5py

        self.path = Path(path)
        validate.check_path(self.path)  # a FIFO or a device is refused before anything opens it
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as exc:
            if not h5py.is_hdf5(self.path):
                raise FormatError(f"'{self.path}' is not an HDF5 file") from None
            raise FormatError(f"'{self.path}' cannot be read: truncated or corrupt HDF5 ({_first_line(exc)})") from None
        self._mapped = MappedReader(self.path)
        try:
            with reading(self.path):  # a damaged table read while validating: one line, not h5py's traceback
                self.meta = validate.read_attrs(self.file, "the root group", self.path)
                self._validate()
        except BaseException:
            self.close()
            raise

    def _validate(self) -> None:
        """Everything a reader relies on, checked once here (docs/format.md "Reading untrusted files"): root
        attributes, then every link and dataset of the file (`format/validate.py`), then what they form: the call
        tree, the /stats, /random, /local and /unprobed tables, the optimizer's state and the batch size
        (`format/consistency.py`) — of each step's iteration, in a multi-step recording, and then its steps."""
        validate.check_root_attrs(self.meta, self.path, SCHEMA_VERSION, SCHEMA)
        self._tree = validate.check_tree(self.file, self.path)
        self._steps: dict[int, IterationFile] = {}
        self._signatures: dict[str, Signature] = {}
        if "steps" not in self.meta:
            self._validate_iteration()
            return
        self._stats_index, self._stats_raw, self._pass_through = {}, {}, set()
        for name in self._tree.groups.get(STEPS, ({}, []))[1]:
            self._steps[int(name)] = self._view(int(name))
        first = self._steps[min(self._steps)] if self._steps else None
        params = set(first.state(STATE_BEFORE)) if first is not None else set()
        tables = {name: (self._matrix(name), self.attrs(name).get("columns"))
                  for name in (SIGNATURE, TWIN_SIGNATURE) if name in self._tree.datasets}
        losses = {s: float(v.read(LOSS).reshape(-1)[0]) for s, v in self._steps.items()
                  if v.has(LOSS) and v.shape_of(LOSS) in ((), (1,))}
        steps = consistency.check_steps(self.meta, self._tree.groups, tables, params, self.path, losses)
        self._steps = {s: self._steps[s] for s in steps}
        for name, (values, columns) in tables.items():
            self._signatures[name] = Signature(tuple(steps), tuple(columns or ()), values)

    def _validate_iteration(self) -> None:
        """The structures of one iteration (the file's, or a step's of a multi-step recording)."""
        groups, datasets = self._tree.groups, self._tree.datasets
        consistency.check_calls(groups, self.path)
        self._stats_index = self._read_stats()
        consistency.check_random(groups, datasets, self.path)
        consistency.check_collectives(self.meta, groups, datasets, self._stats_raw, self.path)
        consistency.check_batch_size(self.meta, datasets, self._stats_raw, self.path)
        consistency.check_microbatches(self.meta, groups, datasets, self.path)
        params = set(self._named(STATE_BEFORE)) | set(self._named(STATE_AFTER))
        consistency.check_optimizer_state(self.meta, self._names_in(OPTIMIZER), params, self.path)
        consistency.check_step_start(self._names_in(STEP_START), params, self.path)
        consistency.check_step_start(self._names_in(STEP_GRADS), params, self.path, STEP_GRADS)
        self._pass_through = set()
        if self.local_kind() and LOCAL in datasets:
            self._pass_through = consistency.check_local(self.local_rows(), self.unprobed(), groups, datasets,
                                                         params, self.path)

    def _view(self, step: int) -> "IterationFile":
        """Iteration `step` of a multi-step recording as an IterationFile of its own (validated like one): its
        paths are relative to `/steps/<step>`, its `meta` that group's attributes; it shares this file's handle."""
        view = copy.copy(self)
        prefix = step_group(step)
        view._tree = self._tree.subtree(prefix)
        view.meta = dict(view._tree.groups[""][0])
        view.file = _Rooted(self.file, prefix)
        view._owner, view._steps, view._signatures = False, {}, {}
        view._local_rows = view._calls = None
        view._validate_iteration()
        return view

    def _matrix(self, name: str) -> np.ndarray:
        try:
            return np.asarray(self.file[name][()], dtype=np.float64)
        except Exception as exc:  # noqa: BLE001 - a damaged table
            raise FormatError(f"'{self.path}': /{name} cannot be read ({_first_line(exc)})") from None

    # -- a multi-step recording ---------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The iterations a multi-step recording holds, in order; [] for a recording of one iteration."""
        return list(self._steps)

    def step(self, step: int) -> "IterationFile":
        """Iteration `step` of a multi-step recording, read like a recording of that iteration alone."""
        if step not in self._steps:
            raise OneIterError(f"'{self.path}' holds no step {step} (it holds {_ranges(self.steps())})")
        return self._steps[step]

    def signature(self, twin: bool = False) -> Signature | None:
        """The per-step signature rows (`format/signature.py`): the run's own, or its perturbed twin's (`twin`); None
        if the file holds none."""
        return self._signatures.get(TWIN_SIGNATURE if twin else SIGNATURE)

    def _read_stats(self) -> dict[str, tuple]:
        """path -> (Stats, dtype name, shape) of every stats-level entry (`/stats`), each row checked
        (`consistency.stats_index`); empty for a full recording."""
        self._stats_raw = {}
        table = self.file.get(STATS)
        if table is None:
            return {}
        try:
            self._stats_raw = consistency.stats_index(table[()], self.path)
        except FormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged row
            raise FormatError(f"'{self.path}': the /{STATS} table cannot be read ({_first_line(exc)})") from None
        return {p: (Stats(values, checksum, kind), dtype, shape)
                for p, (values, checksum, kind, dtype, shape) in self._stats_raw.items()}

    def __enter__(self) -> "IterationFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._owner:  # a step's view: the file is its recording's
            return
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
        return self._stats_index

    def dataset_id(self, path: str):
        """Identity of what is stored at `path`: equal for two names hard-linked to one dataset."""
        return ("stats", path) if path in self.stats_index else self._dataset(path).addr

    def is_stats(self, path: str) -> bool:
        """A stats-level entry (`record --level stats`): statistics and a checksum, no tensor data."""
        return path in self.stats_index

    def stats_of(self, path: str):
        """The entry's `format.stats.Stats`: stored (stats level) or computed from its data (full level)."""
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
            raise FormatError(f"'{self.path}': cannot read '{path}' ({_first_line(exc)}); "
                              f"the file may be truncated") from None

    def tensor(self, path: str):
        """The tensor as a torch tensor with its original dtype, bit for bit."""
        return to_torch(self.raw(path), self.dtype_of(path))

    def layout(self, path: str) -> tuple | None:
        """The live tensor's (strides, storage offset) as recorded at `path` (validated on open), or None."""
        return layout_from_attrs(self.attrs(path)) if path in self._tree.datasets else None

    def has(self, path: str) -> bool:
        # every link was seen by the validation walk: a dict lookup, not an HDF5 link traversal
        return path in self._tree.datasets or path in self.stats_index or path in self._tree.groups

    def attrs(self, path: str) -> dict[str, Any]:
        """The attributes of a group or dataset, as plain Python values ({} if it does not exist)."""
        if path in self._tree.datasets:
            return dict(self._tree.datasets[path].attrs)
        return dict(self._tree.groups[path][0]) if path in self._tree.groups else {}

    def compiled(self) -> dict[str, Any]:
        """The root attribute `compiled` (JSON, checked on open): the model's compiled blocks (`blocks`: eager path
        -> kind, backend, graphs, hidden_modules), graph breaks and compile seconds; {} for an eager model."""
        text = self.meta.get(COMPILED)
        return json.loads(text) if isinstance(text, str) and text else {}

    def compiled_blocks(self) -> dict[str, dict]:
        """The compiled blocks of the recorded model, by eager module path ("" the model itself)."""
        return dict(self.compiled().get("blocks") or {})

    def local_kind(self) -> str:
        """`teacher_forced`, `against_cpu`, or "" when the file holds no per-layer local results."""
        return str(self.meta.get("local", "") or "")

    @staticmethod
    def _local_fields(rec, names: set) -> dict[str, Any]:
        return {n: plain(rec[n]) if n in names else LOCAL_OPTIONAL[n] for n, _ in LOCAL_FIELDS}

    def local_rows(self) -> list[LocalRow]:
        """The rows of `/local` (empty without local data), read once."""
        if self._local_rows is None:
            table = self.file.get(LOCAL)
            names = set(table.dtype.names or ()) if table is not None else set()
            self._local_rows = [] if table is None else [
                LocalRow(**self._local_fields(rec, names)) for rec in table[()]]
        return list(self._local_rows)

    def pass_through_calls(self) -> set[tuple[str, int]]:
        """(module, call) of the calls of a recording with local data that have nothing of their own to judge (every
        output they recorded is one of their inputs: `consistency.check_local`); the judge holds their outputs to
        their inputs, as it does an unprobed call's."""
        return set(self._pass_through)

    def local_attrs(self) -> dict[str, Any]:
        return self.attrs(LOCAL)

    def impact(self) -> tuple[list[ImpactRow], dict[str, Any]] | None:
        """The rows of `/impact` and its attributes (`record --impact`); None when the file holds none."""
        table = self.file.get(IMPACT)
        if table is None:
            return None
        rows = [ImpactRow(**{n: plain(rec[n]) for n, _ in IMPACT_FIELDS}) for rec in table[()]]
        return rows, self.attrs(IMPACT)

    def unprobed(self) -> list[tuple[str, int, str]]:
        """(module, call, reason) of every call the local probe could not rerun."""
        table = self.file.get(UNPROBED)
        if table is None:
            return []
        return [(plain(r["module"]), int(r["call"]), plain(r["reason"])) for r in table[()]]

    # -- structure --------------------------------------------------------------------------------------------------
    def state(self, which: str = STATE_BEFORE) -> dict[str, str]:
        """Parameter/buffer name -> dataset path, in recorded order."""
        return self._named(which)

    def batch_paths(self, microbatch: int | None = None) -> list[str]:
        """The batch's tensors in order (`batch/input.<n>`); `microbatch`: only that microbatch's."""
        names = sorted(self._names_in(BATCH), key=lambda n: int(n.rpartition(".")[2]))
        paths = [f"{BATCH}/{n}" for n in names]
        if microbatch is None:
            return paths
        return [p for p in paths if int(self.attrs(p).get(MICROBATCH, 0) or 0) == microbatch]

    def microbatches(self) -> int:
        """How many microbatches the iteration ran before its step (docs/format.md "Microbatches"); 1 for most."""
        return int(self.meta.get(MICROBATCHES) or 1)

    def call_microbatches(self) -> dict[tuple[str, int], int]:
        """(module, call) -> the microbatch whose forward made the call, for a recording of several microbatches;
        {} for one of a single microbatch (every call is microbatch 0's)."""
        if self.microbatches() <= 1:
            return {}
        return {(str(a["module"] or ROOT_MODULE), int(a["call"])): int(a.get(MICROBATCH, 0) or 0)
                for _key, a in self.calls()}

    def microbatch_losses(self) -> list[float]:
        """Each microbatch's loss (`/microbatch_loss`), [] for a recording of a single microbatch."""
        if MICROBATCH_LOSS not in self._tree.datasets:
            return []
        return [float(v) for v in np.asarray(self.read(MICROBATCH_LOSS), dtype=np.float64).reshape(-1)]

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

    def names_in(self, group_name: str) -> list[str]:
        """The entries directly in a group (its datasets, and its rows of `/stats`)."""
        return self._names_in(group_name)

    def collectives(self) -> list[tuple[str, dict[str, Any]]]:
        """(group name, attributes) of every collective this rank recorded (`/collectives/<index>`), in order."""
        if COLLECTIVES not in self._tree.groups:
            return []
        names = sorted(self._tree.groups[COLLECTIVES][1], key=int)
        return [(n, dict(self._tree.groups[f"{COLLECTIVES}/{n}"][0])) for n in names]

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        """(call key, attrs) in execution order."""
        if self._calls is None:  # read once: every reader walks the calls several times
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


class _Rooted:
    """The open h5py file seen from a step's group: `get`/`[]`/`in` take paths inside the step."""

    def __init__(self, file, prefix: str):
        self._file, self._prefix = file, prefix

    def get(self, name: str, default=None):
        return self._file.get(f"{self._prefix}/{name}", default)

    def __getitem__(self, name: str):
        return self._file[f"{self._prefix}/{name}"]

    def __contains__(self, name: str) -> bool:
        return f"{self._prefix}/{name}" in self._file

    def close(self) -> None:
        pass


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "no steps"
    return f"steps {steps[0]}..{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else \
        "steps " + ", ".join(map(str, steps))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def reading(*paths: str | os.PathLike):
    """Turn what h5py raises on a damaged file (after its header was accepted) into a one-line FormatError."""
    try:
        yield
    except OneIterError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        names = " / ".join(f"'{p}'" for p in paths)
        raise FormatError(f"cannot read {names}: {text} (truncated or corrupt file?)") from exc
