"""The attributes of a recording, read and checked: the path before anything opens it, the root attributes every
reader relies on (a step group's as an iteration's root), a call group's attributes. Part of the checks
`IterationFile` runs before anything reads a file (`validate.py` walks the tree and calls these); every refusal is
a one-line `FormatError` naming the file, the attribute, what was expected and what was found."""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, TypeGuard

import h5py
import numpy as np

from oneiter.errors import FormatError
from oneiter.format.optimizer_state import OPTIMIZER_STATE, VALUES
from oneiter.format.schema import COMPILED, MICROBATCH, MICROBATCHES, OPTIMIZER_CLASS, STATE_NAMES, plain

__all__ = ["check_call_attrs", "check_path", "check_root_attrs", "decoded", "expect", "fail", "first_line", "is_int",
           "read_attrs", "shown"]

_INT_ATTRS = ("batch_size", "seed", "num_calls", "num_threads", "num_random_ops", "rank", "world_size", "iteration",
              "steps", MICROBATCHES)
_STR_ATTRS = ("model", "device", "device_type", "device_name", "dtype", "amp", "optimizer", "torch_version",
              "oneiter_version", "command", "created", "replay_of", "framework", "mmengine_version", "grad_reduction",
              OPTIMIZER_CLASS)
_JSON_ATTRS = {"model_args": dict, "include": list, "exclude": list, "faults": list, "fallback": list, COMPILED: dict,
               "fallback_counts": dict, STATE_NAMES: dict}
_CHOICES = {"level": ("full", "stats"), "local": ("", "teacher_forced", "against_cpu"), OPTIMIZER_STATE: VALUES}
_CALL_INT_ATTRS = ("exec_index", "random_begin", "random_end", "seq_input", "seq_output", "seq_grad_output",
                   "seq_grad_input", MICROBATCH)


def fail(path, text: str) -> FormatError:
    return FormatError(f"'{path}': {text}")


def shown(value: Any) -> str:
    """A value found in a file, for a message: short, one line, with its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


# -- before opening -------------------------------------------------------------------------------------------------
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_path(path) -> None:
    """Refuse what is not a regular file before anything opens it: opening a FIFO blocks until a writer comes."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FormatError(f"'{path}' does not exist") from None
    except OSError as exc:
        raise FormatError(f"'{path}' cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise FormatError(f"'{path}' is a directory, expected a .h5 file written by `oneiter record`")
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise FormatError(f"'{path}' is {kind}, expected a regular .h5 file written by `oneiter record`")


# -- attributes -----------------------------------------------------------------------------------------------------
def read_attrs(obj, where: str, path) -> dict[str, Any]:
    """The attributes of an HDF5 object (h5py high-level object or low-level id) as plain Python values, read
    with the low-level API; an unreadable one is a one-line FormatError."""
    try:
        if isinstance(obj, h5py.File):
            obj = h5py.h5o.open(obj.id, b"/")
        oid = obj if isinstance(obj, h5py._objects.ObjectID) else obj.id
        count = h5py.h5a.get_num_attrs(oid)
    except Exception as exc:  # noqa: BLE001 - h5py raises OSError, TypeError, ... on damaged attribute headers
        raise fail(path, f"the attributes of {where} cannot be read ({first_line(exc)})") from None
    values = {}
    for index in range(count):
        name = f"#{index}"
        try:
            attr = h5py.h5a.open(oid, index=index)
            name = decoded(attr.name)
            values[name] = plain(_attr_value(attr))
        except Exception as exc:  # noqa: BLE001
            raise fail(path, f"attribute '{name}' of {where} cannot be read ({first_line(exc)})") from None
    return values


def _attr_value(attr):
    """What h5py's `obj.attrs[name]` returns (h5py 3's `AttributeManager.__getitem__`, without its per-call
    lock, name lookups and type conversions: ~2x faster, which matters at ~1,500 attributes per file)."""
    shape = attr.shape
    if shape is None:  # an empty dataspace
        return h5py.Empty(attr.dtype)
    dtype = attr.dtype
    htype = _MEMORY_TYPES.get(dtype)
    if htype is None:
        htype = _MEMORY_TYPES[dtype] = h5py.h5t.py_create(dtype)
    if dtype.subdtype is not None:  # a top-level array type: numpy wants it as extra dimensions
        dtype, subshape = dtype.subdtype
        shape = shape + subshape
    array = np.zeros(shape, dtype=dtype, order="C")
    attr.read(array, mtype=htype)
    if dtype.kind == "O" and h5py.h5t.check_string_dtype(dtype) is not None:  # variable-length strings: bytes
        if array.ndim == 0:
            return bytes(array[()]).decode("utf-8", "surrogateescape")
        array = np.array([b.decode("utf-8", "surrogateescape") for b in array.flat], dtype=dtype).reshape(array.shape)
    return array[()] if array.ndim == 0 else array


_MEMORY_TYPES: dict = {}  # numpy dtype -> HDF5 memory type (h5py builds one per read otherwise)


def is_int(value) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def expect(path, where: str, name: str, wanted: str, value) -> FormatError:
    return fail(path, f"{where}attribute '{name}': expected {wanted}, got {shown(value)}")


def check_root_attrs(meta: dict[str, Any], path, supported: int, schema: str) -> None:
    """The root attributes every reader relies on, with their types; the order decides which message a file that
    is wrong in several ways gets (not a oneiter file, too new, incomplete, then the rest)."""
    _check_identity(meta, path, supported, schema)
    _check_int_attrs(meta, path)
    _check_other_attrs(meta, path)
    _check_json_attrs(meta, path)


def _check_identity(meta: dict[str, Any], path, supported: int, schema: str) -> None:
    """A oneiter recording, of a schema version this reader knows, finished."""
    if meta.get("schema") != schema:
        raise FormatError(f"'{path}' is an HDF5 file but not a oneiter recording (schema attribute missing)")
    version = meta.get("schema_version")
    if "schema_version" not in meta:
        raise fail(path, f"root attribute 'schema_version' is missing (expected an integer from 1 to {supported})")
    if not is_int(version) or version < 1:
        raise expect(path, "root ", "schema_version", f"an integer from 1 to {supported}", version)
    if version > supported:
        raise FormatError(f"'{path}' has schema version {version}, this oneiter reads up to {supported}: "
                          f"upgrade oneiter")
    complete = meta.get("complete")
    if complete is False or "complete" not in meta:
        raise FormatError(f"'{path}' is incomplete: the run that wrote it did not finish")
    if complete is not True:
        raise expect(path, "root ", "complete", "the boolean True (a finished recording)", complete)


def _check_int_attrs(meta: dict[str, Any], path) -> None:
    """Integer attributes: integers, counts >= 0, a world of at least one rank; the seed an integer or ""."""
    for name in _INT_ATTRS:
        if name in meta and not is_int(meta[name]):
            raise expect(path, "root ", name, "an integer", meta[name])
    for name in ("batch_size", "num_calls", "num_threads", "num_random_ops", "rank", "iteration"):
        if name in meta and meta[name] < 0:
            raise expect(path, "root ", name, "an integer >= 0", meta[name])
    for name in ("world_size", MICROBATCHES):
        if name in meta and meta[name] < 1:
            raise expect(path, "root ", name, "an integer >= 1", meta[name])
    if "steps" in meta and not 1 <= meta["steps"] <= 10**9:
        raise expect(path, "root ", "steps", "an integer from 1 to 10**9 (the iterations a multi-step recording "
                      "holds)", meta["steps"])
    if "rng_seed" in meta and not (is_int(meta["rng_seed"]) or meta["rng_seed"] == ""):
        raise expect(path, "root ", "rng_seed", "an integer or \"\"", meta["rng_seed"])


def _check_other_attrs(meta: dict[str, Any], path) -> None:
    """Strings, choices among fixed values, the random_replay flag and the loss."""
    for name in _STR_ATTRS:
        if name in meta and not isinstance(meta[name], str):
            raise expect(path, "root ", name, "a string", meta[name])
    for name, choices in _CHOICES.items():
        if name in meta and meta[name] not in choices:
            raise expect(path, "root ", name, " or ".join(f"'{c}'" for c in choices), meta[name])
    if "random_replay" in meta and not isinstance(meta["random_replay"], bool):
        raise expect(path, "root ", "random_replay", "a boolean", meta["random_replay"])
    if "loss" in meta and (not isinstance(meta["loss"], (int, float)) or isinstance(meta["loss"], bool)):
        raise expect(path, "root ", "loss", "a number", meta["loss"])
    for name in ("twin_roundoff", "twin_check"):  # a multi-step replay's twin (`record/steps/twin.py`)
        value = meta.get(name)
        if name in meta and (not isinstance(value, float) or not (value >= 0 or math.isnan(value))
                             or math.isinf(value)):
            raise expect(path, "root ", name, "a number >= 0 (or NaN)", value)


def _check_json_attrs(meta: dict[str, Any], path) -> None:
    """Attributes holding JSON: a string that parses to an object or a list, as each one's kind says; empty or
    absent is allowed."""
    for name, kind in _JSON_ATTRS.items():
        value = meta.get(name)
        if value in (None, ""):
            continue
        try:
            parsed = json.loads(value) if isinstance(value, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, kind):
            raise expect(path, "root ", name, f"a JSON {'object' if kind is dict else 'list'} string", value)
        blocks = parsed.get("blocks", {}) if name == COMPILED else {}
        if not isinstance(blocks, dict) or not all(isinstance(v, dict) for v in blocks.values()):
            raise fail(path, f"root attribute '{COMPILED}': expected its 'blocks' to be an object of objects (a "
                              f"compiled block's path -> what is known of it), got {shown(blocks)}")


def check_call_attrs(attrs: dict[str, Any], key: str, path) -> None:
    where = f"call group '{key}' "
    for name in ("module", "call"):
        if name not in attrs:
            raise fail(path, f"{where}has no attribute '{name}'")
    for name in ("module", "parent", "class_name"):
        if name in attrs and not isinstance(attrs[name], str):
            raise expect(path, where, name, "a string", attrs[name])
    if not is_int(attrs["call"]) or attrs["call"] < 0:
        raise expect(path, where, "call", "an integer >= 0", attrs["call"])
    for name in _CALL_INT_ATTRS:
        if name in attrs and not is_int(attrs[name]):
            raise expect(path, where, name, "an integer", attrs[name])


def decoded(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else str(raw)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
