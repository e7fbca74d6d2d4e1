"""Reading untrusted recordings safely: the checks `IterationFile` runs before anything reads a file.

A recording may come from anywhere (a colleague, a bug report, a CI artifact), so opening one must never read
another file, hang, allocate without bound or fail with a traceback. `IterationFile.__init__` (the one door every
reader goes through: compare, inspect, replay, `record --replay`, the mmengine hook) calls, in order:

- `check_path`: the path is a regular file (a FIFO would block `open` forever, a device read without end);
- `check_root_attrs`: `schema`, `schema_version` (an int this version reads), `complete` (the boolean True) and
  the type of every other root attribute a reader uses;
- `check_tree`: every link in the file, walked without following any first: no external links, soft links only
  to a dataset inside the file, no second link to a group (so no cycles), no committed datatypes; every dataset
  stored in the file itself (no external raw storage, no virtual dataset, only HDF5's built-in filters) and
  holding the bytes its shape says (a chunked dataset of 2**33 unwritten elements is refused, not read as
  gigabytes of fill value); tensors numeric with a `dtype` attribute that matches their stored type; tables
  with their columns; call groups with typed attributes. The walk keeps what it saw (`Tree`: each dataset's
  shape, types, attributes and where its bytes lie; each group's attributes and links), and readers answer from
  it instead of asking HDF5 again.

Every refusal is a `FormatError`: one line naming the file, the object or attribute, what was expected and what
was found.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from oneiter.errors import FormatError
from oneiter.format.optimizer_state import OPTIMIZER_STATE, VALUES
from oneiter.format.schema import (
    COLLECTIVE_ATTRS,
    COLLECTIVES,
    COMPILED,
    GLOBAL_OFFSET,
    GLOBAL_SHAPE,
    LOCAL_FIELDS,
    LOCAL_OPTIONAL,
    MICROBATCH,
    MICROBATCH_LOSS,
    MICROBATCHES,
    OPTIMIZER,
    OPTIMIZER_CLASS,
    P2P_ATTRS,
    P2P_OPS,
    PLACEMENTS,
    RAW_BITS,
    SCHEMA,
    SCHEMA_VERSION,
    SIGNATURE,
    STATE_NAMES,
    STATS_FIELDS,
    STEP_GRADS,
    STEP_START,
    STEPS,
    STORAGE_OFFSET,
    STRIDE,
    TWIN_SIGNATURE,
    UNPROBED_FIELDS,
    UNREDUCED_GRADS,
    collective_index,
    plain,
    split_optimizer_entry,
)

__all__ = ["check_path", "check_root_attrs", "check_tree", "read_attrs", "MAX_EXPANSION", "Stored", "Tree"]

# HDF5's own filters (deflate, shuffle, fletcher32, szip, nbit, scaleoffset) and h5py's built-in lzf: never a plugin
# (HDF5 loads unknown filters as shared libraries from its plugin path)
_BUILTIN_FILTERS = {1: "deflate", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset", 32000: "lzf"}
MAX_EXPANSION = 1024  # a compressed dataset may unpack to at most this many times its stored bytes (+ 1 MiB)

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
_TENSOR_GROUPS = ("batch", "state_before", "param_grads", "state_after", "random", OPTIMIZER, STEP_START,
                  UNREDUCED_GRADS, STEP_GRADS)
_COLLECTIVE_TENSOR = re.compile(r"(input|output)\.(0|[1-9]\d{0,8})")
_TABLES = ("local", "unprobed", "stats")
# a multi-step recording's root tables, one row per step (`signature.py`)
_STEP_TABLES = (SIGNATURE, TWIN_SIGNATURE)
_STEP_NAME = re.compile(r"0|[1-9]\d{0,11}")  # its number as written: no leading zero
# torch dtypes stored as the numpy type of the same name (the others are raw bits: `schema.RAW_BITS`)
_NUMPY_NAMED = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "bool", "complex64", "complex128"}
_RANDOM_NAME = re.compile(r"\d+(\.\d+)?")
_BATCH_NAME = re.compile(r"input\.\d+")


def _fail(path, text: str) -> FormatError:
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
        raise _fail(path, f"the attributes of {where} cannot be read ({_first_line(exc)})") from None
    values = {}
    for index in range(count):
        name = f"#{index}"
        try:
            attr = h5py.h5a.open(oid, index=index)
            name = _decoded(attr.name)
            values[name] = plain(_attr_value(attr))
        except Exception as exc:  # noqa: BLE001
            raise _fail(path, f"attribute '{name}' of {where} cannot be read ({_first_line(exc)})") from None
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
            return array[()].decode("utf-8", "surrogateescape")
        array = np.array([b.decode("utf-8", "surrogateescape") for b in array.flat], dtype=dtype).reshape(array.shape)
    return array[()] if array.ndim == 0 else array


_MEMORY_TYPES: dict = {}  # numpy dtype -> HDF5 memory type (h5py builds one per read otherwise)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(path, where: str, name: str, wanted: str, value) -> FormatError:
    return _fail(path, f"{where}attribute '{name}': expected {wanted}, got {shown(value)}")


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
        raise _fail(path, f"root attribute 'schema_version' is missing (expected an integer from 1 to {supported})")
    if not _is_int(version) or version < 1:
        raise _expect(path, "root ", "schema_version", f"an integer from 1 to {supported}", version)
    if version > supported:
        raise FormatError(f"'{path}' has schema version {version}, this oneiter reads up to {supported}: "
                          f"upgrade oneiter")
    complete = meta.get("complete")
    if complete is False or "complete" not in meta:
        raise FormatError(f"'{path}' is incomplete: the run that wrote it did not finish")
    if complete is not True:
        raise _expect(path, "root ", "complete", "the boolean True (a finished recording)", complete)


def _check_int_attrs(meta: dict[str, Any], path) -> None:
    """Integer attributes: integers, counts >= 0, a world of at least one rank; the seed an integer or ""."""
    for name in _INT_ATTRS:
        if name in meta and not _is_int(meta[name]):
            raise _expect(path, "root ", name, "an integer", meta[name])
    for name in ("batch_size", "num_calls", "num_threads", "num_random_ops", "rank", "iteration"):
        if name in meta and meta[name] < 0:
            raise _expect(path, "root ", name, "an integer >= 0", meta[name])
    for name in ("world_size", MICROBATCHES):
        if name in meta and meta[name] < 1:
            raise _expect(path, "root ", name, "an integer >= 1", meta[name])
    if "steps" in meta and not 1 <= meta["steps"] <= 10**9:
        raise _expect(path, "root ", "steps", "an integer from 1 to 10**9 (the iterations a multi-step recording "
                      "holds)", meta["steps"])
    if "rng_seed" in meta and not (_is_int(meta["rng_seed"]) or meta["rng_seed"] == ""):
        raise _expect(path, "root ", "rng_seed", "an integer or \"\"", meta["rng_seed"])


def _check_other_attrs(meta: dict[str, Any], path) -> None:
    """Strings, choices among fixed values, the random_replay flag and the loss."""
    for name in _STR_ATTRS:
        if name in meta and not isinstance(meta[name], str):
            raise _expect(path, "root ", name, "a string", meta[name])
    for name, choices in _CHOICES.items():
        if name in meta and meta[name] not in choices:
            raise _expect(path, "root ", name, " or ".join(f"'{c}'" for c in choices), meta[name])
    if "random_replay" in meta and not isinstance(meta["random_replay"], bool):
        raise _expect(path, "root ", "random_replay", "a boolean", meta["random_replay"])
    if "loss" in meta and (not isinstance(meta["loss"], (int, float)) or isinstance(meta["loss"], bool)):
        raise _expect(path, "root ", "loss", "a number", meta["loss"])
    for name in ("twin_roundoff", "twin_check"):  # a multi-step replay's twin (`record/steps/twin.py`)
        value = meta.get(name)
        if name in meta and (not isinstance(value, float) or not (value >= 0 or math.isnan(value))
                             or math.isinf(value)):
            raise _expect(path, "root ", name, "a number >= 0 (or NaN)", value)


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
            raise _expect(path, "root ", name, f"a JSON {'object' if kind is dict else 'list'} string", value)
        blocks = parsed.get("blocks", {}) if name == COMPILED else {}
        if not isinstance(blocks, dict) or not all(isinstance(v, dict) for v in blocks.values()):
            raise _fail(path, f"root attribute '{COMPILED}': expected its 'blocks' to be an object of objects (a "
                              f"compiled block's path -> what is known of it), got {shown(blocks)}")


def _check_call_attrs(attrs: dict[str, Any], key: str, path) -> None:
    where = f"call group '{key}' "
    for name in ("module", "call"):
        if name not in attrs:
            raise _fail(path, f"{where}has no attribute '{name}'")
    for name in ("module", "parent", "class_name"):
        if name in attrs and not isinstance(attrs[name], str):
            raise _expect(path, where, name, "a string", attrs[name])
    if not _is_int(attrs["call"]) or attrs["call"] < 0:
        raise _expect(path, where, "call", "an integer >= 0", attrs["call"])
    for name in _CALL_INT_ATTRS:
        if name in attrs and not _is_int(attrs[name]):
            raise _expect(path, where, name, "an integer", attrs[name])


# -- the tree -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """One dataset as the walk found it: what a reader needs without asking HDF5 again."""

    addr: int  # the object's address: equal for two names hard-linked to one dataset
    shape: tuple[int, ...]
    dtype: np.dtype  # as stored (bfloat16: uint16 bits)
    name: str | None  # a tensor's `dtype` attribute (its torch dtype); None for tables
    offset: int | None  # where contiguous, unfiltered, allocated data starts in the file (a mapping can read it)
    attrs: dict[str, Any]


@dataclass
class Tree:
    """Everything `check_tree` saw: every dataset by path, and every group's attributes and link names."""

    datasets: dict[str, Stored] = field(default_factory=dict)
    groups: dict[str, tuple[dict[str, Any], list[str]]] = field(default_factory=dict)

    def subtree(self, prefix: str) -> "Tree":
        """What lies under the group `prefix` (a multi-step recording's `steps/<step>`), with paths relative to it:
        the tree of one iteration, as a file holding only it would have (the group's attributes as the root's)."""
        head = prefix + "/"
        sub = Tree()
        sub.datasets = {p[len(head):]: d for p, d in self.datasets.items() if p.startswith(head)}
        sub.groups = {p[len(head):]: g for p, g in self.groups.items() if p.startswith(head)}
        sub.groups[""] = self.groups[prefix]
        return sub


def check_tree(file, path) -> Tree:
    """Walk every link of the open h5py file, link objects first (nothing followed before it is checked), through
    HDF5's low-level API (resnet18's 1,055 links: 0.15 s with h5py's high-level objects, 0.085 s so). Returns the
    `Tree` it saw, so readers need not ask HDF5 for links, attributes or storage again."""
    from h5py import h5o

    try:
        root = h5o.open(file.id, b"/")
        seen_groups = {h5o.get_info(root).addr}
    except Exception as exc:  # noqa: BLE001
        raise _fail(path, f"the root group cannot be opened ({_first_line(exc)}); the file is damaged") from None
    tree = Tree()
    tree.groups[""] = (read_attrs(root, "the root group", path), [])
    seen_datasets: dict[int, tuple] = {}
    stack = [("", root)]
    while stack:
        where, group = stack.pop()
        names = tree.groups[where][1]
        for raw, kind, addr in _links(group, where, path):
            name = _decoded(raw)
            full = f"{where}/{name}" if where else name
            names.append(name)
            obj, obj_addr = _open_link(group, raw, kind, addr, full, path)
            _add_object(tree, obj, obj_addr, full, path, seen_groups, seen_datasets, stack)
    return tree


def _links(group, where: str, path) -> list[tuple[bytes, int, int]]:
    """Every link of `group` as (name, link type, address or value size), listed before any is followed."""
    links: list[tuple[bytes, int, int]] = []
    try:
        group.links.iterate(lambda name, info: links.append((name, info.type, info.u)), info=True)
    except Exception as exc:  # noqa: BLE001
        raise _fail(path, f"group '/{where}' cannot be listed ({_first_line(exc)}); the file is damaged") from None
    return links


def _open_link(group, raw: bytes, kind: int, addr: int, full: str, path) -> tuple:
    """The object a hard or soft link names and its address; external and user-defined links are refused."""
    from h5py import h5l, h5o

    if kind == h5l.TYPE_EXTERNAL:
        filename, target = _link_value(group, raw, full, path)
        raise _fail(path, f"'/{full}' is an external link to '{filename}' (path '{target}'): a recording "
                          f"never refers to other files")
    if kind == h5l.TYPE_SOFT:
        return _soft_target(group, raw, full, _link_value(group, raw, full, path), path)
    if kind == h5l.TYPE_HARD:
        try:
            return h5o.open(group, raw), addr
        except Exception as exc:  # noqa: BLE001
            raise _fail(path, f"'/{full}' cannot be opened ({_first_line(exc)}); the file is damaged") from None
    raise _fail(path, f"'/{full}' is a user-defined link (type {kind}): not in a recording")


def _add_object(tree: Tree, obj, addr: int, full: str, path, seen_groups: set, seen_datasets: dict,
                stack: list) -> None:
    """Check a group (queued to be walked; a second link to one is refused) or a dataset (its storage checked once
    per address) and add it to `tree`; anything else is refused."""
    if isinstance(obj, h5py.h5g.GroupID):
        if addr in seen_groups:
            raise _fail(path, f"'/{full}' is a second link to a group already in the file (a cycle?): "
                              f"a recording links only datasets")
        seen_groups.add(addr)
        tree.groups[full] = (_check_group(obj, full, path), [])
        stack.append((full, obj))
    elif isinstance(obj, h5py.h5d.DatasetID):
        if addr not in seen_datasets:
            seen_datasets[addr] = _check_storage(obj, full, path)
        tree.datasets[full] = _check_dataset(obj, full, path, addr, seen_datasets[addr])
    else:
        kind_name = "Datatype" if isinstance(obj, h5py.h5t.TypeID) else type(obj).__name__
        raise _fail(path, f"'/{full}' is a {kind_name}, expected a group or a dataset")


def _decoded(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else str(raw)


def _link_value(group, raw: bytes, full: str, path):
    """A soft link's target path, or an external link's (file name, path)."""
    try:
        value = group.links.get_val(raw)
    except Exception as exc:  # noqa: BLE001
        raise _fail(path, f"link '/{full}' cannot be read ({_first_line(exc)})") from None
    return tuple(_decoded(v) for v in value) if isinstance(value, tuple) else _decoded(value)


def _soft_target(group, raw: bytes, full: str, target: str, path):
    """The dataset a soft link names and its address; refused when it dangles or names a group (which could
    close a cycle)."""
    try:
        obj = h5py.h5o.open(group, raw)
        addr = h5py.h5o.get_info(obj).addr
    except Exception:  # noqa: BLE001 - a chain of soft links longer than HDF5 allows, or a loop
        obj = None
    if obj is None:
        raise _fail(path, f"'/{full}' is a soft link to '{target}', which does not exist in the file")
    if not isinstance(obj, h5py.h5d.DatasetID):
        kind = "Group" if isinstance(obj, h5py.h5g.GroupID) else "Datatype"
        raise _fail(path, f"'/{full}' is a soft link to '{target}', a {kind}: a recording's links name datasets "
                          f"only")
    return obj, addr


def _iteration_parts(full: str, path) -> list[str]:
    """The parts of a path inside its iteration: a multi-step recording's `steps/<step>/...` without that prefix
    (checked: a step number, no steps inside a step); any other path as it is. `steps/<step>` itself is []."""
    parts = full.split("/")
    if parts[0] != STEPS:
        return parts
    if len(parts) > 1 and not _STEP_NAME.fullmatch(parts[1]):
        raise _fail(path, f"'/{full}': expected /{STEPS}/<step>, a step number, got '{parts[1]}'")
    inner = parts[2:]
    if inner and inner[0] == STEPS:
        raise _fail(path, f"'/{full}': a step holds no steps of its own")
    return inner


def _check_group(group, full: str, path) -> dict[str, Any]:
    """Groups where the layout has groups; call groups' attributes; a multi-step recording's step groups (each an
    iteration's root, its attributes checked like a file's). Returns the group's attributes."""
    if full == STEPS:
        return read_attrs(group, f"'/{full}'", path)
    parts = _iteration_parts(full, path)
    if not parts:  # /steps/<step>: one iteration of a multi-step recording
        return _check_step_group(group, full, path)
    top = parts[0]
    if top in (*_TABLES, "loss", MICROBATCH_LOSS):
        raise _fail(path, f"'/{full}' is a group, expected a dataset")
    if top in _TENSOR_GROUPS and len(parts) > 1:
        raise _fail(path, f"'/{full}' is a group, expected a dataset (tensor)")
    attrs = read_attrs(group, f"'/{full}'", path)
    if top == "calls":
        _check_calls_group(parts, attrs, full, path)
    if top == COLLECTIVES:
        _check_collectives_group(parts, attrs, full, path)
    if top in ("state_before", "param_grads", "state_after", OPTIMIZER, STEP_START, UNREDUCED_GRADS, STEP_GRADS) \
            and len(parts) == 1:
        order = attrs.get("order")
        if order is not None and not (isinstance(order, list) and all(isinstance(n, str) for n in order)):
            raise _expect(path, f"group '/{full}' ", "order", "a list of strings", order)
    if top == "random" and len(parts) == 1:
        _check_num_ops(attrs, full, path)
    return attrs


def _check_num_ops(attrs: dict[str, Any], full: str, path) -> None:
    num_ops = attrs.get("num_ops", 0)
    if not _is_int(num_ops) or num_ops < 0:
        raise _expect(path, f"group '/{full}' ", "num_ops", "an integer >= 0", num_ops)


def _check_step_group(group, full: str, path) -> dict[str, Any]:
    """A step of a multi-step recording: its attributes are an iteration's root attributes."""
    attrs = read_attrs(group, f"'/{full}'", path)
    try:
        check_root_attrs(attrs, path, SCHEMA_VERSION, SCHEMA)
    except FormatError as err:
        said = str(err).replace(f"'{path}'", "", 1).lstrip(": ").replace("root attribute", "attribute")
        raise _fail(path, f"step group '/{full}': {said}") from None
    if "steps" in attrs:
        raise _fail(path, f"step group '/{full}' has attribute 'steps': a step holds no steps of its own")
    return attrs


def _check_calls_group(parts: list[str], attrs: dict[str, Any], full: str, path) -> None:
    """Under /calls: call groups named <module>@<call> with their attributes, holding 'forward' and 'backward'."""
    if len(parts) == 2:
        module, at, call = parts[1].rpartition("@")
        if not at or not call.isdigit():
            raise _fail(path, f"'/{full}': expected a call group named <module>@<call>")
        _check_call_attrs(attrs, parts[1], path)
    elif len(parts) == 3 and parts[2] not in ("forward", "backward", "local"):  # local: version 1, unread
        raise _fail(path, f"'/{full}': expected 'forward' or 'backward' in a call group, got '{parts[2]}'")
    elif len(parts) > 3:
        raise _fail(path, f"'/{full}' is a group, expected a dataset (tensor)")


def _check_collectives_group(parts: list[str], attrs: dict[str, Any], full: str, path) -> None:
    """Under /collectives: one group per collective named by its index (five digits at least), its attributes of
    the types `schema.COLLECTIVE_ATTRS` says, holding tensors only."""
    if len(parts) == 1:
        _check_num_ops(attrs, full, path)
        return
    if len(parts) > 2:
        raise _fail(path, f"'/{full}' is a group, expected a dataset (tensor)")
    if collective_index(parts[1]) is None:
        raise _fail(path, f"'/{full}': expected a collective group named by its index (00000, 00001, ...)")
    where = f"collective group '/{full}' "
    wanted_attrs = {**COLLECTIVE_ATTRS, **(P2P_ATTRS if attrs.get("op") in P2P_OPS else {})}
    for name, kind in wanted_attrs.items():
        value = attrs.get(name)
        ok = _is_int(value) if kind is int else isinstance(value, kind)
        if kind is list and ok:
            ok = all(_is_int(v) for v in value)
        if not ok:
            wanted = {int: "an integer", str: "a string", bool: "a boolean", list: "a list of integers"}[kind]
            raise _expect(path, where, name, wanted, value)


def _check_storage(dset, full: str, path) -> tuple[tuple[int, ...], np.dtype, int | None]:
    """Data stored in this file only, by built-in filters, with as many bytes as the shape says. Returns (shape,
    stored numpy dtype, offset of contiguous unfiltered data or None)."""
    try:
        plist = dset.get_create_plist()
        layout = plist.get_layout()
        if layout == h5py.h5d.VIRTUAL:
            raise _fail(path, f"'/{full}' is a virtual dataset (its data lives in other files): not in a recording")
        if plist.get_external_count() > 0:
            target = plist.get_external(0)[0]
            target = target.decode("utf-8", "backslashreplace") if isinstance(target, bytes) else target
            raise _fail(path, f"'/{full}' keeps its data in the external file '{target}': a recording stores "
                              f"every tensor inside itself")
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        unknown = [f for f in filters if f not in _BUILTIN_FILTERS]
        if unknown:
            raise _fail(path, f"'/{full}' needs HDF5 filter {unknown[0]}, not a built-in one: refused (a plugin "
                              f"would run code)")
        shape = tuple(int(s) for s in dset.shape) if dset.shape is not None else ()
        size = int(np.prod(shape, dtype=np.int64)) if shape else (0 if dset.shape is None else 1)
        logical = size * int(dset.get_type().get_size())
        stored = int(dset.get_storage_size())
        offset = dset.get_offset() if layout == h5py.h5d.CONTIGUOUS and not filters else None
    except FormatError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _fail(path, f"'/{full}' cannot be read ({_first_line(exc)}); the file is damaged") from None
    if not filters and stored < logical:
        raise _fail(path, f"'/{full}' has shape {shape} ({logical} bytes) but stores {stored} bytes: "
                          f"a sparse or truncated dataset")
    if filters and logical > MAX_EXPANSION * stored + 2**20:
        raise _fail(path, f"'/{full}' would expand from {stored} stored bytes to {logical}: refused")
    try:
        dtype = dset.dtype
    except Exception as exc:  # noqa: BLE001
        raise _fail(path, f"'/{full}' has an HDF5 type numpy cannot read ({_first_line(exc)})") from None
    return shape, dtype, offset


def _check_dataset(dset, full: str, path, addr: int, storage: tuple) -> Stored:
    """Tensors: numeric, with a `dtype` attribute matching the stored type; tables: their columns."""
    shape, dtype, offset = storage
    if full.split("/")[0] == STEPS and full.count("/") < 2:
        raise _fail(path, f"'/{full}' is a dataset, expected a group (/{STEPS} holds one group per step)")
    parts = _iteration_parts(full, path)
    top = parts[0]
    if full in _STEP_TABLES:
        _check_matrix(shape, dtype, full, path)
        return Stored(addr, shape, dtype, None, offset, read_attrs(dset, f"'/{full}'", path))
    tensor = (top in ("loss", MICROBATCH_LOSS) and len(parts) == 1) or (top in _TENSOR_GROUPS and len(parts) == 2) or \
        (top == "calls" and len(parts) == 4 and parts[2] in ("forward", "backward")) or \
        (top == COLLECTIVES and len(parts) == 3)
    if (top == "calls" and len(parts) < 4) or (top == COLLECTIVES and len(parts) < 3):
        raise _fail(path, f"'/{full}' is a dataset, expected a group")
    if top in _TENSOR_GROUPS and len(parts) == 1:
        raise _fail(path, f"'/{full}' is a dataset, expected a group")
    attrs = read_attrs(dset, f"'/{full}'", path)
    stored = Stored(addr, shape, dtype, None, offset, attrs)
    if top in _TABLES and len(parts) == 1:
        _check_table(shape, dtype, top, full, path)
        return stored
    if not tensor:
        return stored
    if dtype.names is not None or dtype.kind not in "biufc":
        raise _fail(path, f"'/{full}': expected a numeric tensor dataset, got HDF5 type {dtype}")
    _check_tensor_name(parts, attrs, full, path)
    name = _tensor_dtype_name(attrs, dtype, full, path)
    if top == "calls":
        _check_layout(attrs, shape, full, path)
    _check_shard(attrs, shape, full, path)
    return Stored(addr, shape, dtype, name, offset, attrs)


def _check_shard(attrs: dict[str, Any], shape: tuple[int, ...], full: str, path) -> None:
    """A rank's shard of a sharded (FSDP2) tensor: `placements` a string, `global_shape` one integer >= 0 per
    dimension, each at least the shard's, and `global_offset` (where present) placing the shard inside it."""
    if PLACEMENTS not in attrs and GLOBAL_SHAPE not in attrs and GLOBAL_OFFSET not in attrs:
        return
    where = f"dataset '/{full}' "
    if not isinstance(attrs.get(PLACEMENTS), str):
        raise _expect(path, where, PLACEMENTS, "a string (the shard's placements)", attrs.get(PLACEMENTS))
    full_shape = attrs.get(GLOBAL_SHAPE)
    if not (isinstance(full_shape, list) and len(full_shape) == len(shape)
            and all(_is_int(g) and g >= n for g, n in zip(full_shape, shape, strict=True))):
        raise _expect(path, where, GLOBAL_SHAPE, f"{len(shape)} integers, each at least the shard's {list(shape)}",
                      full_shape)
    offset = attrs.get(GLOBAL_OFFSET)
    if offset is not None and not (isinstance(offset, list) and len(offset) == len(shape) and all(
            _is_int(o) and 0 <= o and o + n <= g for o, n, g in zip(offset, shape, full_shape, strict=True))):
        raise _expect(path, where, GLOBAL_OFFSET, "one integer per dimension placing the shard inside "
                      f"{full_shape}", offset)


def _check_layout(attrs: dict[str, Any], shape: tuple[int, ...], full: str, path) -> None:
    """A call tensor's `stride` and `storage_offset` (both or neither): non-negative integers, one stride per
    dimension, and a storage a rerun can allocate: at most `MAX_EXPANSION` times the elements the dataset holds
    (+ 1 Mi), as a compressed dataset may expand (a replay lays the tensor out in a fresh buffer of that size)."""
    if STRIDE not in attrs and STORAGE_OFFSET not in attrs:
        return
    stride, offset = attrs.get(STRIDE), attrs.get(STORAGE_OFFSET)
    where = f"dataset '/{full}' "
    if not (isinstance(stride, list) and len(stride) == len(shape) and all(_is_int(s) and s >= 0 for s in stride)):
        raise _expect(path, where, STRIDE, f"{len(shape)} integers >= 0 (one per dimension)", stride)
    if not (_is_int(offset) and offset >= 0):
        raise _expect(path, where, STORAGE_OFFSET, "an integer >= 0", offset)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if numel else 0
    if extent > MAX_EXPANSION * numel + 2**20:
        raise _fail(path, f"'/{full}': its layout (stride {stride}, storage offset {offset}) spans {extent} "
                          f"elements for the {numel} it holds: refused")


def _check_tensor_name(parts: list[str], attrs: dict[str, Any], full: str, path) -> None:
    """Batch tensors are input.<i>; random ops <index> or <index>.<output>, with an `op` attribute; optimizer
    state values <parameter>.<key>."""
    top = parts[0]
    if top == OPTIMIZER and split_optimizer_entry(parts[1]) is None:
        raise _fail(path, f"'/{full}': expected an optimizer state value named <parameter>.<key>")
    if top == "batch" and not _BATCH_NAME.fullmatch(parts[1]):
        raise _fail(path, f"'/{full}': expected a batch tensor named input.<i>")
    if top == "random" and not _RANDOM_NAME.fullmatch(parts[1]):
        raise _fail(path, f"'/{full}': expected a random op named <index> or <index>.<output>")
    if top == COLLECTIVES and not _COLLECTIVE_TENSOR.fullmatch(parts[2]):
        raise _fail(path, f"'/{full}': expected a collective's tensor named input.<i> or output.<i>")
    if top == "random" and not isinstance(attrs.get("op"), str):
        raise _expect(path, f"dataset '/{full}' ", "op", "a string", attrs.get("op"))


def _tensor_dtype_name(attrs: dict[str, Any], dtype: np.dtype, full: str, path) -> str:
    """The tensor's `dtype` attribute: a torch dtype name whose stored numpy type is the data's."""
    name = attrs.get("dtype")
    if not isinstance(name, str):
        raise _expect(path, f"dataset '/{full}' ", "dtype", "a torch dtype name (string)", name)
    if name in RAW_BITS:
        expected = np.dtype(RAW_BITS[name])
    elif name in _NUMPY_NAMED:
        expected = np.dtype(name)
    else:
        raise _expect(path, f"dataset '/{full}' ", "dtype", "a torch dtype name", name)
    if expected != dtype:
        raise _fail(path, f"'/{full}': attribute 'dtype' says {name}, which is stored as {expected}, but the data "
                          f"is {dtype}")
    return name


def _check_matrix(shape, dtype, full: str, path) -> None:
    """A multi-step table: float64 rows (one per step) of at least one column (`format/signature.py`)."""
    if len(shape) != 2 or shape[1] < 1 or dtype != np.dtype("float64"):
        raise _fail(path, f"'/{full}': expected a float64 table of one row per step, got {dtype} with shape {shape}")


def _check_table(shape, dtype, table: str, full: str, path) -> None:
    fields = {"local": LOCAL_FIELDS, "unprobed": UNPROBED_FIELDS, "stats": STATS_FIELDS}[table]
    if dtype.names is None or len(shape) != 1:
        raise _fail(path, f"'/{full}': expected a one-dimensional table, got {dtype} with shape {shape}")
    kinds = {"str": "OSU", "i8": "iu", "f8": "f"}
    for name, kind in fields:
        if table == "local" and name in LOCAL_OPTIONAL and name not in dtype.names:
            continue  # a file from before the column
        if name not in dtype.names or dtype[name].kind not in kinds[kind]:
            got = dtype[name] if name in dtype.names else "no such column"
            raise _fail(path, f"'/{full}': column '{name}': expected {kind}, got {got}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
