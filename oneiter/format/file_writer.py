"""The recording as a file, written: `FileWriter` creates one recording and writes its datasets, links, tables and
attributes through HDF5's API; `layout.py`'s `IterationFile` reads what it wrote. The names it writes under are
`schema.py`'s (docs/format.md); the recorder's background thread (`writer.py`) is its only user in a recording run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from oneiter.format.schema import (
    IMPACT,
    IMPACT_FIELDS,
    LOCAL,
    LOCAL_FIELDS,
    SCHEMA,
    SCHEMA_VERSION,
    STATS,
    STATS_FIELDS,
    UNPROBED,
    UNPROBED_FIELDS,
    ImpactRow,
    LocalRow,
    group_path,
)

__all__ = ["FileWriter", "impact_dataset"]


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

    def impact_table(self, rows: list[ImpactRow], attrs: dict[str, Any]) -> None:
        """`/impact` (one row per run of the iteration from its start: `record --impact`), with its attrs."""
        impact_dataset(self.file, rows, attrs)

    def finish(self, attrs: dict[str, Any]) -> None:
        if self._stats:
            rows = [(path, *stats.values, *stats.checksum, stats.kind, dtype, ",".join(map(str, shape)))
                    for path, (stats, dtype, shape) in self._stats.items()]
            self.file.create_dataset(STATS, data=np.array(rows, dtype=_table_dtype(STATS_FIELDS)))
        self.file.attrs.update(_clean_attrs(attrs))
        self.file.attrs["complete"] = True
        self.file.close()

    def abort(self, empty_first: bool = False) -> None:
        """Close without marking the file complete. `empty_first` (after a write error): truncate the file to 0
        bytes before closing, so the metadata flush of close finds free blocks even on a full disk."""
        try:
            if empty_first:
                os.ftruncate(self.file.id.get_vfd_handle(), 0)
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


def impact_dataset(group, rows: list[ImpactRow], attrs: dict[str, Any]) -> None:
    """`/impact` in the open h5py `group` (a file's root, one iteration's or a multi-step recording's)."""
    table = np.array([tuple(getattr(r, n) for n, _ in IMPACT_FIELDS) for r in rows], dtype=_table_dtype(IMPACT_FIELDS))
    group.create_dataset(IMPACT, data=table).attrs.update(_clean_attrs(attrs))


def _table_dtype(fields) -> np.dtype:
    import h5py

    return np.dtype([(n, h5py.string_dtype() if t == "str" else t) for n, t in fields])
