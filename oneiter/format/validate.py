"""Reading untrusted recordings safely: the checks `IterationFile` runs before anything reads a file.

A recording may come from anywhere (a colleague, a bug report, a CI artifact), so opening one must never read
another file, hang, allocate without bound or fail with a traceback. `IterationFile.__init__` (the one door every
reader goes through: compare, inspect, replay, `record --replay`, the mmengine hook) calls, in order (the first two
live in `attributes.py`, re-exported here):

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

import re
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from oneiter.errors import FormatError
from oneiter.format.attributes import (
    check_call_attrs,
    check_path,
    check_root_attrs,
    decoded,
    expect,
    fail,
    first_line,
    is_int,
    read_attrs,
)
from oneiter.format.schema import (
    COLLECTIVE_ATTRS,
    COLLECTIVES,
    GLOBAL_OFFSET,
    GLOBAL_SHAPE,
    IMPACT_FIELDS,
    LOCAL_FIELDS,
    LOCAL_OPTIONAL,
    MICROBATCH_LOSS,
    OPTIMIZER,
    P2P_ATTRS,
    P2P_OPS,
    PLACEMENTS,
    RAW_BITS,
    SCHEMA,
    SCHEMA_VERSION,
    SIGNATURE,
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
    split_optimizer_entry,
)

__all__ = ["check_path", "check_root_attrs", "check_tree", "read_attrs", "MAX_EXPANSION", "Stored", "Tree"]

# HDF5's own filters (deflate, shuffle, fletcher32, szip, nbit, scaleoffset) and h5py's built-in lzf: never a plugin
# (HDF5 loads unknown filters as shared libraries from its plugin path)
_BUILTIN_FILTERS = {1: "deflate", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset", 32000: "lzf"}
MAX_EXPANSION = 1024  # a compressed dataset may unpack to at most this many times its stored bytes (+ 1 MiB)

_TENSOR_GROUPS = ("batch", "state_before", "param_grads", "state_after", "random", OPTIMIZER, STEP_START,
                  UNREDUCED_GRADS, STEP_GRADS)
_COLLECTIVE_TENSOR = re.compile(r"(input|output)\.(0|[1-9]\d{0,8})")
_TABLES = ("local", "unprobed", "stats", "impact")
# a multi-step recording's root tables, one row per step (`signature.py`)
_STEP_TABLES = (SIGNATURE, TWIN_SIGNATURE)
_STEP_NAME = re.compile(r"0|[1-9]\d{0,11}")  # its number as written: no leading zero
# torch dtypes stored as the numpy type of the same name (the others are raw bits: `schema.RAW_BITS`)
_NUMPY_NAMED = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "bool", "complex64", "complex128"}
_RANDOM_NAME = re.compile(r"\d+(\.\d+)?")
_BATCH_NAME = re.compile(r"input\.\d+")


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
        raise fail(path, f"the root group cannot be opened ({first_line(exc)}); the file is damaged") from None
    tree = Tree()
    tree.groups[""] = (read_attrs(root, "the root group", path), [])
    seen_datasets: dict[int, tuple] = {}
    stack = [("", root)]
    while stack:
        where, group = stack.pop()
        names = tree.groups[where][1]
        for raw, kind, addr in _links(group, where, path):
            name = decoded(raw)
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
        raise fail(path, f"group '/{where}' cannot be listed ({first_line(exc)}); the file is damaged") from None
    return links


def _open_link(group, raw: bytes, kind: int, addr: int, full: str, path) -> tuple:
    """The object a hard or soft link names and its address; external and user-defined links are refused."""
    from h5py import h5l, h5o

    if kind == h5l.TYPE_EXTERNAL:
        filename, target = _link_value(group, raw, full, path)
        raise fail(path, f"'/{full}' is an external link to '{filename}' (path '{target}'): a recording "
                          f"never refers to other files")
    if kind == h5l.TYPE_SOFT:
        return _soft_target(group, raw, full, _link_value(group, raw, full, path), path)
    if kind == h5l.TYPE_HARD:
        try:
            return h5o.open(group, raw), addr
        except Exception as exc:  # noqa: BLE001
            raise fail(path, f"'/{full}' cannot be opened ({first_line(exc)}); the file is damaged") from None
    raise fail(path, f"'/{full}' is a user-defined link (type {kind}): not in a recording")


def _add_object(tree: Tree, obj, addr: int, full: str, path, seen_groups: set, seen_datasets: dict,
                stack: list) -> None:
    """Check a group (queued to be walked; a second link to one is refused) or a dataset (its storage checked once
    per address) and add it to `tree`; anything else is refused."""
    if isinstance(obj, h5py.h5g.GroupID):
        if addr in seen_groups:
            raise fail(path, f"'/{full}' is a second link to a group already in the file (a cycle?): "
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
        raise fail(path, f"'/{full}' is a {kind_name}, expected a group or a dataset")



def _link_value(group, raw: bytes, full: str, path):
    """A soft link's target path, or an external link's (file name, path)."""
    try:
        value = group.links.get_val(raw)
    except Exception as exc:  # noqa: BLE001
        raise fail(path, f"link '/{full}' cannot be read ({first_line(exc)})") from None
    return tuple(decoded(v) for v in value) if isinstance(value, tuple) else decoded(value)


def _soft_target(group, raw: bytes, full: str, target: str, path):
    """The dataset a soft link names and its address; refused when it dangles or names a group (which could
    close a cycle)."""
    try:
        obj = h5py.h5o.open(group, raw)
        addr = h5py.h5o.get_info(obj).addr
    except Exception:  # noqa: BLE001 - a chain of soft links longer than HDF5 allows, or a loop
        obj = None
    if obj is None:
        raise fail(path, f"'/{full}' is a soft link to '{target}', which does not exist in the file")
    if not isinstance(obj, h5py.h5d.DatasetID):
        kind = "Group" if isinstance(obj, h5py.h5g.GroupID) else "Datatype"
        raise fail(path, f"'/{full}' is a soft link to '{target}', a {kind}: a recording's links name datasets "
                          f"only")
    return obj, addr


def _iteration_parts(full: str, path) -> list[str]:
    """The parts of a path inside its iteration: a multi-step recording's `steps/<step>/...` without that prefix
    (checked: a step number, no steps inside a step); any other path as it is. `steps/<step>` itself is []."""
    parts = full.split("/")
    if parts[0] != STEPS:
        return parts
    if len(parts) > 1 and not _STEP_NAME.fullmatch(parts[1]):
        raise fail(path, f"'/{full}': expected /{STEPS}/<step>, a step number, got '{parts[1]}'")
    inner = parts[2:]
    if inner and inner[0] == STEPS:
        raise fail(path, f"'/{full}': a step holds no steps of its own")
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
        raise fail(path, f"'/{full}' is a group, expected a dataset")
    if top in _TENSOR_GROUPS and len(parts) > 1:
        raise fail(path, f"'/{full}' is a group, expected a dataset (tensor)")
    attrs = read_attrs(group, f"'/{full}'", path)
    if top == "calls":
        _check_calls_group(parts, attrs, full, path)
    if top == COLLECTIVES:
        _check_collectives_group(parts, attrs, full, path)
    if top in ("state_before", "param_grads", "state_after", OPTIMIZER, STEP_START, UNREDUCED_GRADS, STEP_GRADS) \
            and len(parts) == 1:
        order = attrs.get("order")
        if order is not None and not (isinstance(order, list) and all(isinstance(n, str) for n in order)):
            raise expect(path, f"group '/{full}' ", "order", "a list of strings", order)
    if top == "random" and len(parts) == 1:
        _check_num_ops(attrs, full, path)
    return attrs


def _check_num_ops(attrs: dict[str, Any], full: str, path) -> None:
    num_ops = attrs.get("num_ops", 0)
    if not is_int(num_ops) or num_ops < 0:
        raise expect(path, f"group '/{full}' ", "num_ops", "an integer >= 0", num_ops)


def _check_step_group(group, full: str, path) -> dict[str, Any]:
    """A step of a multi-step recording: its attributes are an iteration's root attributes."""
    attrs = read_attrs(group, f"'/{full}'", path)
    try:
        check_root_attrs(attrs, path, SCHEMA_VERSION, SCHEMA)
    except FormatError as err:
        said = str(err).replace(f"'{path}'", "", 1).lstrip(": ").replace("root attribute", "attribute")
        raise fail(path, f"step group '/{full}': {said}") from None
    if "steps" in attrs:
        raise fail(path, f"step group '/{full}' has attribute 'steps': a step holds no steps of its own")
    return attrs


def _check_calls_group(parts: list[str], attrs: dict[str, Any], full: str, path) -> None:
    """Under /calls: call groups named <module>@<call> with their attributes, holding 'forward' and 'backward'."""
    if len(parts) == 2:
        module, at, call = parts[1].rpartition("@")
        if not at or not call.isdigit():
            raise fail(path, f"'/{full}': expected a call group named <module>@<call>")
        check_call_attrs(attrs, parts[1], path)
    elif len(parts) == 3 and parts[2] not in ("forward", "backward", "local"):  # local: version 1, unread
        raise fail(path, f"'/{full}': expected 'forward' or 'backward' in a call group, got '{parts[2]}'")
    elif len(parts) > 3:
        raise fail(path, f"'/{full}' is a group, expected a dataset (tensor)")


def _check_collectives_group(parts: list[str], attrs: dict[str, Any], full: str, path) -> None:
    """Under /collectives: one group per collective named by its index (five digits at least), its attributes of
    the types `schema.COLLECTIVE_ATTRS` says, holding tensors only."""
    if len(parts) == 1:
        _check_num_ops(attrs, full, path)
        return
    if len(parts) > 2:
        raise fail(path, f"'/{full}' is a group, expected a dataset (tensor)")
    if collective_index(parts[1]) is None:
        raise fail(path, f"'/{full}': expected a collective group named by its index (00000, 00001, ...)")
    where = f"collective group '/{full}' "
    wanted_attrs = {**COLLECTIVE_ATTRS, **(P2P_ATTRS if attrs.get("op") in P2P_OPS else {})}
    for name, kind in wanted_attrs.items():
        value = attrs.get(name)
        ok = is_int(value) if kind is int else isinstance(value, kind)
        if kind is list and ok and isinstance(value, list):
            ok = all(is_int(v) for v in value)
        if not ok:
            wanted = {int: "an integer", str: "a string", bool: "a boolean", list: "a list of integers"}[kind]
            raise expect(path, where, name, wanted, value)


def _check_storage(dset, full: str, path) -> tuple[tuple[int, ...], np.dtype, int | None]:
    """Data stored in this file only, by built-in filters, with as many bytes as the shape says. Returns (shape,
    stored numpy dtype, offset of contiguous unfiltered data or None)."""
    try:
        plist = dset.get_create_plist()
        layout = plist.get_layout()
        if layout == h5py.h5d.VIRTUAL:
            raise fail(path, f"'/{full}' is a virtual dataset (its data lives in other files): not in a recording")
        if plist.get_external_count() > 0:
            target = plist.get_external(0)[0]
            target = target.decode("utf-8", "backslashreplace") if isinstance(target, bytes) else target
            raise fail(path, f"'/{full}' keeps its data in the external file '{target}': a recording stores "
                              f"every tensor inside itself")
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        unknown = [f for f in filters if f not in _BUILTIN_FILTERS]
        if unknown:
            raise fail(path, f"'/{full}' needs HDF5 filter {unknown[0]}, not a built-in one: refused (a plugin "
                              f"would run code)")
        shape = tuple(int(s) for s in dset.shape) if dset.shape is not None else ()
        size = int(np.prod(shape, dtype=np.int64)) if shape else (0 if dset.shape is None else 1)
        logical = size * int(dset.get_type().get_size())
        stored = int(dset.get_storage_size())
        offset = dset.get_offset() if layout == h5py.h5d.CONTIGUOUS and not filters else None
    except FormatError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise fail(path, f"'/{full}' cannot be read ({first_line(exc)}); the file is damaged") from None
    if not filters and stored < logical:
        raise fail(path, f"'/{full}' has shape {shape} ({logical} bytes) but stores {stored} bytes: "
                          f"a sparse or truncated dataset")
    if filters and logical > MAX_EXPANSION * stored + 2**20:
        raise fail(path, f"'/{full}' would expand from {stored} stored bytes to {logical}: refused")
    try:
        dtype = dset.dtype
    except Exception as exc:  # noqa: BLE001
        raise fail(path, f"'/{full}' has an HDF5 type numpy cannot read ({first_line(exc)})") from None
    return shape, dtype, offset


def _check_dataset(dset, full: str, path, addr: int, storage: tuple) -> Stored:
    """Tensors: numeric, with a `dtype` attribute matching the stored type; tables: their columns."""
    shape, dtype, offset = storage
    if full.split("/")[0] == STEPS and full.count("/") < 2:
        raise fail(path, f"'/{full}' is a dataset, expected a group (/{STEPS} holds one group per step)")
    parts = _iteration_parts(full, path)
    top = parts[0]
    if full in _STEP_TABLES:
        _check_matrix(shape, dtype, full, path)
        return Stored(addr, shape, dtype, None, offset, read_attrs(dset, f"'/{full}'", path))
    tensor = (top in ("loss", MICROBATCH_LOSS) and len(parts) == 1) or (top in _TENSOR_GROUPS and len(parts) == 2) or \
        (top == "calls" and len(parts) == 4 and parts[2] in ("forward", "backward")) or \
        (top == COLLECTIVES and len(parts) == 3)
    if (top == "calls" and len(parts) < 4) or (top == COLLECTIVES and len(parts) < 3):
        raise fail(path, f"'/{full}' is a dataset, expected a group")
    if top in _TENSOR_GROUPS and len(parts) == 1:
        raise fail(path, f"'/{full}' is a dataset, expected a group")
    attrs = read_attrs(dset, f"'/{full}'", path)
    stored = Stored(addr, shape, dtype, None, offset, attrs)
    if top in _TABLES and len(parts) == 1:
        _check_table(shape, dtype, top, full, path)
        return stored
    if not tensor:
        return stored
    if dtype.names is not None or dtype.kind not in "biufc":
        raise fail(path, f"'/{full}': expected a numeric tensor dataset, got HDF5 type {dtype}")
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
        raise expect(path, where, PLACEMENTS, "a string (the shard's placements)", attrs.get(PLACEMENTS))
    full_shape = attrs.get(GLOBAL_SHAPE)
    if not (isinstance(full_shape, list) and len(full_shape) == len(shape)
            and all(is_int(g) and g >= n for g, n in zip(full_shape, shape, strict=True))):
        raise expect(path, where, GLOBAL_SHAPE, f"{len(shape)} integers, each at least the shard's {list(shape)}",
                      full_shape)
    offset = attrs.get(GLOBAL_OFFSET)
    if offset is not None and not (isinstance(offset, list) and len(offset) == len(shape) and all(
            is_int(o) and 0 <= o and o + n <= g for o, n, g in zip(offset, shape, full_shape, strict=True))):
        raise expect(path, where, GLOBAL_OFFSET, "one integer per dimension placing the shard inside "
                      f"{full_shape}", offset)


def _check_layout(attrs: dict[str, Any], shape: tuple[int, ...], full: str, path) -> None:
    """A call tensor's `stride` and `storage_offset` (both or neither): non-negative integers, one stride per
    dimension, and a storage a rerun can allocate: at most `MAX_EXPANSION` times the elements the dataset holds
    (+ 1 Mi), as a compressed dataset may expand (a replay lays the tensor out in a fresh buffer of that size)."""
    if STRIDE not in attrs and STORAGE_OFFSET not in attrs:
        return
    stride, offset = attrs.get(STRIDE), attrs.get(STORAGE_OFFSET)
    where = f"dataset '/{full}' "
    if not (isinstance(stride, list) and len(stride) == len(shape) and all(is_int(s) and s >= 0 for s in stride)):
        raise expect(path, where, STRIDE, f"{len(shape)} integers >= 0 (one per dimension)", stride)
    if not (is_int(offset) and offset >= 0):
        raise expect(path, where, STORAGE_OFFSET, "an integer >= 0", offset)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if numel else 0
    if extent > MAX_EXPANSION * numel + 2**20:
        raise fail(path, f"'/{full}': its layout (stride {stride}, storage offset {offset}) spans {extent} "
                          f"elements for the {numel} it holds: refused")


def _check_tensor_name(parts: list[str], attrs: dict[str, Any], full: str, path) -> None:
    """Batch tensors are input.<i>; random ops <index> or <index>.<output>, with an `op` attribute; optimizer
    state values <parameter>.<key>."""
    top = parts[0]
    if top == OPTIMIZER and split_optimizer_entry(parts[1]) is None:
        raise fail(path, f"'/{full}': expected an optimizer state value named <parameter>.<key>")
    if top == "batch" and not _BATCH_NAME.fullmatch(parts[1]):
        raise fail(path, f"'/{full}': expected a batch tensor named input.<i>")
    if top == "random" and not _RANDOM_NAME.fullmatch(parts[1]):
        raise fail(path, f"'/{full}': expected a random op named <index> or <index>.<output>")
    if top == COLLECTIVES and not _COLLECTIVE_TENSOR.fullmatch(parts[2]):
        raise fail(path, f"'/{full}': expected a collective's tensor named input.<i> or output.<i>")
    if top == "random" and not isinstance(attrs.get("op"), str):
        raise expect(path, f"dataset '/{full}' ", "op", "a string", attrs.get("op"))


def _tensor_dtype_name(attrs: dict[str, Any], dtype: np.dtype, full: str, path) -> str:
    """The tensor's `dtype` attribute: a torch dtype name whose stored numpy type is the data's."""
    name = attrs.get("dtype")
    if not isinstance(name, str):
        raise expect(path, f"dataset '/{full}' ", "dtype", "a torch dtype name (string)", name)
    if name in RAW_BITS:
        expected = np.dtype(RAW_BITS[name])
    elif name in _NUMPY_NAMED:
        expected = np.dtype(name)
    else:
        raise expect(path, f"dataset '/{full}' ", "dtype", "a torch dtype name", name)
    if expected != dtype:
        raise fail(path, f"'/{full}': attribute 'dtype' says {name}, which is stored as {expected}, but the data "
                          f"is {dtype}")
    return name


def _check_matrix(shape, dtype, full: str, path) -> None:
    """A multi-step table: float64 rows (one per step) of at least one column (`format/signature.py`)."""
    if len(shape) != 2 or shape[1] < 1 or dtype != np.dtype("float64"):
        raise fail(path, f"'/{full}': expected a float64 table of one row per step, got {dtype} with shape {shape}")


def _check_table(shape, dtype, table: str, full: str, path) -> None:
    fields = {"local": LOCAL_FIELDS, "unprobed": UNPROBED_FIELDS, "stats": STATS_FIELDS, "impact": IMPACT_FIELDS}[table]
    if dtype.names is None or len(shape) != 1:
        raise fail(path, f"'/{full}': expected a one-dimensional table, got {dtype} with shape {shape}")
    kinds = {"str": "OSU", "i8": "iu", "f8": "f"}
    for name, kind in fields:
        if table == "local" and name in LOCAL_OPTIONAL and name not in dtype.names:
            continue  # a file from before the column
        if name not in dtype.names or dtype[name].kind not in kinds[kind]:
            got = dtype[name] if name in dtype.names else "no such column"
            raise fail(path, f"'/{full}': column '{name}': expected {kind}, got {got}")
