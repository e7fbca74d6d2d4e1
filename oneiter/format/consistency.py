"""What a recording's parts form, checked as structures before any reader walks them (`IterationFile` runs these
after `validate.py`'s walk has checked every link, type and byte count).

A file can hold well-typed objects that still make no sense together, and a reader that trusts them can loop
forever (a call that is its own parent), let one copy hide another (two groups for one module call, two `/stats`
rows for one entry), allocate without bound (`num_ops` 2**62) or pass forged numbers as a MATCH (a negative error,
NaN counts that contradict their mismatch count, a call whose rows were deleted). So, one line naming the object
(`FormatError`, exit 2) for:

- **calls** (`check_calls`): each group's name is `<module>@<call>` of its own `module` and `call` attributes (one
  group per module call); a `parent` is "" or another call of the file, and following parents ends (no cycle);
- **`/stats`** (`stats_index`): one row per entry path; `numel` a whole number >= 0 that the shape's dimensions
  multiply to; NaN/Inf counts whole, >= 0, together at most `numel`; `l2` and `abs_sum` >= 0; `min <= max` and
  both finite when any element is finite;
- **`/random`** (`check_random`): ops numbered 0..num_ops-1 with no gap (`num_ops` is the number found, checked
  before anything is sized by it), each op's outputs numbered 0..k-1 under one `op` name, an op name
  (`aten.<op>.<overload>`) of a random op with the outputs it records (native_dropout: output and mask);
- **`/collectives`** (`check_collectives`): collectives numbered 0..num_ops-1 with no gap, each an op, reduction and
  phase oneiter knows, a group of distinct ranks below the run's `world_size` that holds this file's `rank`, one
  collective per (group, place on the group), a root inside the group (or -1), split sizes one per rank of the
  group, a `call` that is "" or a call of the file, and tensors `input.<i>`, `output.<i>` numbered without a gap; a
  point-to-point op (send, recv) a peer in its group other than this rank, one op per place on its channel (group,
  direction, peer, tag), a tag >= 0, a microbatch the iteration ran, and no place on the group (`group_seq` -1);
- **microbatches** (`check_microbatches`): every call's and batch tensor's `microbatch` below the root's
  `microbatches`, and `/microbatch_loss` there exactly when it is above 1, one value per microbatch;
- **`batch_size`** (`check_batch_size`): no larger than the number of elements the recorded batch holds (a
  builder makes at least one per sample): a replay builds the model with it before it loads the recorded batch;
- **`/local`, `/unprobed`** (`check_local`): rows name calls of the file (parameter rows: a recorded parameter or
  buffer), phases and dtypes it knows, one row per (call, phase, tensor); errors >= 0 or NaN, cosine in [-1, 1] or
  NaN, an error of 0 exactly when the largest difference is 0; counts whole and >= 0, NaN/Inf counts at most
  `numel`, and `mismatch` (positions whose NaN/Inf differ) at least |nan - nan_ref| and |inf - inf_ref| and at most
  nan + nan_ref + inf + inf_ref; noise >= 0 or NaN. Every call of a recording with local data has rows, an
  `/unprobed` entry, or nothing of its own to judge (every output it recorded is one of its inputs, stored once:
  a dropout with p=0, an identity): a call with no verdict is never silent. Those pass-through calls are returned,
  and the judge holds their outputs to their inputs as it does an unprobed call's;
- **`/optimizer_state`** (`check_optimizer_state`): present exactly when the root attribute `optimizer_state` says
  `recorded` or `loaded`, each value named `<parameter>.<key>` of a parameter the file records;
- **`/step_start`** (`check_step_start`): each tensor a parameter the file records;
- **a multi-step recording** (`check_steps`): as many `/steps/<step>` groups as its `steps` attribute says, each
  holding iteration `<step>` (its `iteration` attribute), and signature tables of one row per step whose columns
  (`format/signature.py`) name the loss and parameters of the recording, norms >= 0 (or NaN/Inf, a run that overflowed),
  and whose loss column is each step's recorded loss.
"""

from __future__ import annotations

import math
import re
from typing import Any

from oneiter.errors import FormatError
from oneiter.format.optimizer_state import LOADED, OPTIMIZER_STATE, RECORDED
from oneiter.format.schema import (
    BACKWARD,
    BATCH,
    CALLS,
    CLIP_ROW,
    COLLECTIVE_OPS,
    COLLECTIVES,
    FORWARD,
    MICROBATCH,
    MICROBATCH_LOSS,
    MICROBATCHES,
    OPTIMIZER_MODULE,
    P2P_OPS,
    RANDOM,
    RANDOM_OPS,
    RANDOM_OUTPUTS,
    RAW_BITS,
    REDUCE_OPS,
    ROOT_MODULE,
    SIGNATURE,
    STATS_VALUES,
    STEP_START,
    STEPS,
    LocalRow,
    call_key,
    collective_group,
    plain,
)
from oneiter.format.signature import check_columns

__all__ = ["check_calls", "stats_index", "check_random", "check_batch_size", "check_microbatches",
           "check_local", "check_step_start",
           "OPTIMIZER_CALL", "LOCAL_PHASES", "check_optimizer_state", "check_steps"]

_RANDOM_OP = re.compile(r"aten\.(?P<packet>[A-Za-z_][A-Za-z0-9_]*)\.[A-Za-z0-9_]+")
OPTIMIZER_CALL = (OPTIMIZER_MODULE, 0)  # how /unprobed names the optimizer's shadow step (and /local its clipping)
LOCAL_PHASES = ("forward", "backward", "param_grad", "optimizer")
_TENSOR_DTYPES = {"float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
                  "uint32", "uint64", "bool", "complex64", "complex128", *RAW_BITS}
_WIDE = ("float64", "complex128", "int64", "uint64")  # sums of squares of these may overflow float64
_MAX_ELEMENTS = 2**62  # more elements than any machine holds: a count above it is no count


def _fail(path, text: str) -> FormatError:
    return FormatError(f"'{path}': {text}")


def _whole(value: Any) -> bool:
    """A whole number (an int, or a float that holds one exactly) from 0 to _MAX_ELEMENTS."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer() and 0 <= value <= _MAX_ELEMENTS
    return isinstance(value, int) and 0 <= value <= _MAX_ELEMENTS


# -- calls ----------------------------------------------------------------------------------------------------------
def check_calls(groups: dict[str, tuple[dict, list]], path) -> None:
    """One group per module call, parents that exist and form a tree (`groups`: the walk's `Tree.groups`)."""
    keys = groups[CALLS][1] if CALLS in groups else []
    parents: dict[str, str] = {}
    for key in keys:
        attrs = groups[f"{CALLS}/{key}"][0]
        own = call_key(str(attrs["module"]), int(attrs["call"]))
        if own != key:
            raise _fail(path, f"call group '{key}' has module '{attrs['module']}' and call {attrs['call']}, whose "
                              f"group is '{own}': one group per module call")
        parents[key] = str(attrs.get("parent") or "")
    for key, parent in parents.items():
        if parent and parent not in parents:
            raise _fail(path, f"call group '{key}' has parent '{parent}', which is no call of the file")
    done: set[str] = set()
    for key in parents:
        seen: list[str] = []
        at = key
        while at and at not in done:
            if at in seen:
                raise _fail(path, f"call group '{key}': its parents form a cycle ({' -> '.join([*seen, at])})")
            seen.append(at)
            at = parents[at]
        done.update(seen)


# -- /stats ---------------------------------------------------------------------------------------------------------
def stats_index(rows, path) -> dict[str, tuple]:
    """path -> (values, checksum, kind, dtype name, shape) of every `/stats` row, each checked (module docstring)."""
    index: dict[str, tuple] = {}
    for i, row in enumerate(rows):
        entry = plain(row["path"])
        if entry in index:
            raise _fail(path, f"/stats row {i}: a second row for '{entry}' (one row per entry)")
        values = [float(row[n]) for n in STATS_VALUES]
        shape = _stats_shape(plain(row["shape"]), i, entry, path)
        _check_stats_values(dict(zip(STATS_VALUES, values, strict=True)), shape, plain(row["dtype"]), i, entry, path)
        index[entry] = (values, (int(row["checksum0"]), int(row["checksum1"])), plain(row["checksum_kind"]),
                        plain(row["dtype"]), shape)
    return index


def _stats_shape(text: str, i: int, entry: str, path) -> tuple[int, ...]:
    parts = [p for p in str(text).split(",") if p]
    if not all(p.isdigit() and len(p) <= 19 for p in parts):
        raise _fail(path, f"/stats row {i} ('{entry}'): shape '{text}' is not a list of dimensions >= 0")
    return tuple(int(p) for p in parts)


def _check_stats_values(v: dict[str, float], shape: tuple[int, ...], dtype: str, i: int, entry: str, path) -> None:
    where = f"/stats row {i} ('{entry}')"
    for name in ("numel", "nan", "inf"):
        if not _whole(v[name]):
            raise _fail(path, f"{where}: {name} {v[name]!r} is not a whole number >= 0")
    if math.prod(shape) != v["numel"]:
        raise _fail(path, f"{where}: numel {int(v['numel'])} but shape {list(shape)}")
    if v["nan"] + v["inf"] > v["numel"]:
        raise _fail(path, f"{where}: {int(v['nan'])} NaN and {int(v['inf'])} Inf among {int(v['numel'])} elements")
    for name in ("l2", "abs_sum"):  # over the finite elements: only float64 values are large enough to overflow
        if not v[name] >= 0 or (math.isinf(v[name]) and dtype not in _WIDE):  # NaN fails too
            raise _fail(path, f"{where}: {name} {v[name]!r}, expected >= 0 (finite for {dtype})")
    if v["nan"] + v["inf"] < v["numel"]:  # some element is finite: min, max and mean are numbers
        if not all(math.isfinite(v[n]) for n in ("min", "max", "mean")) or v["min"] > v["max"]:
            raise _fail(path, f"{where}: min {v['min']!r}, max {v['max']!r}, mean {v['mean']!r}: expected finite "
                              f"numbers with min <= max")


# -- /random --------------------------------------------------------------------------------------------------------
def check_random(groups: dict[str, tuple[dict, list]], datasets: dict, path) -> None:
    """Random ops 0..num_ops-1, each with its outputs under one op name of a random op (module docstring)."""
    if RANDOM not in groups:
        return
    attrs, names = groups[RANDOM]
    ops: dict[int, dict[int, str]] = {}
    for name in names:
        head, _, out = name.partition(".")
        ops.setdefault(int(head), {})[int(out or 0)] = datasets[f"{RANDOM}/{name}"].attrs.get("op")
    num_ops = attrs.get("num_ops", len(ops))
    if num_ops != len(ops) or (ops and max(ops) != len(ops) - 1):
        gap = next((k for k in range(len(ops)) if k not in ops), len(ops))
        raise _fail(path, f"group '/{RANDOM}' says num_ops {num_ops} but holds {len(ops)} random ops (first "
                          f"missing: {gap}); the file is damaged")
    for index, outputs in ops.items():
        _check_random_op(index, outputs, path)


def _check_random_op(index: int, outputs: dict[int, str], path) -> None:
    where = f"random op {index}"
    kinds = set(outputs.values())
    if len(kinds) != 1:
        raise _fail(path, f"{where}: its outputs name different ops ({', '.join(sorted(map(str, kinds)))})")
    op = kinds.pop()
    match = _RANDOM_OP.fullmatch(str(op))
    if match is None or match["packet"] not in RANDOM_OPS:
        raise _fail(path, f"{where}: op '{op}' is not a random aten op (aten.<op>.<overload>)")
    wanted = RANDOM_OUTPUTS.get(match["packet"], 1)
    found = sorted(outputs)
    if found != list(range(wanted)):
        raise _fail(path, f"{where}: {op} records {wanted} output(s), the file holds {len(found)} ({found})")


# -- /collectives ---------------------------------------------------------------------------------------------------
def check_collectives(meta: dict[str, Any], groups: dict[str, tuple[dict, list]], datasets: dict,
                      stats: dict[str, tuple], path) -> None:
    """The collectives a rank recorded (module docstring); attribute types were checked by the walk."""
    if COLLECTIVES not in groups:
        return
    attrs, names = groups[COLLECTIVES]
    num_ops = attrs.get("num_ops", len(names))
    indices = sorted(int(n) for n in names)
    if num_ops != len(names) or indices != list(range(len(names))):
        gap = next((k for k in range(len(names)) if k not in set(indices)), len(names))
        raise _fail(path, f"group '/{COLLECTIVES}' says num_ops {num_ops} but holds {len(names)} collectives (first "
                          f"missing: {gap}); the file is damaged")
    world, rank = int(meta.get("world_size") or 1), meta.get("rank")
    places: set[tuple] = set()
    for index in indices:
        group = collective_group(index)
        attrs = groups[group][0]
        _check_collective(attrs, index, world, rank, groups, path)
        if attrs["op"] in P2P_OPS:
            _check_p2p(attrs, index, rank, int(meta.get(MICROBATCHES) or 1), path)
            place: tuple = (attrs["group"], attrs["op"], attrs["peer"], attrs["tag"], attrs["p2p_seq"])
        else:
            place = (attrs["group"], attrs["group_seq"])
        if place in places:
            raise _fail(path, f"collective {index}: a second op at place {place[-1]} of group '{place[0]}'" + (
                f" with rank {place[2]} (tag {place[3]})" if len(place) > 2 else ""))
        places.add(place)
        held = {p.rpartition("/")[2] for p in (*datasets, *stats) if p.startswith(group + "/")}
        for kind in ("input", "output"):
            numbers = sorted(int(n.partition(".")[2]) for n in held if n.startswith(kind + "."))
            if numbers != list(range(len(numbers))):
                raise _fail(path, f"collective {index}: its {kind} tensors are numbered {numbers}, expected 0..k-1")


def _check_collective(attrs: dict[str, Any], index: int, world: int, rank, groups: dict, path) -> None:
    where = f"collective {index}"
    ranks = attrs["group_ranks"]
    checks = (
        (attrs["op"] in COLLECTIVE_OPS, f"op '{attrs['op']}' is not one of {', '.join(COLLECTIVE_OPS)}"),
        (attrs["reduce_op"] in REDUCE_OPS, f"reduce_op '{attrs['reduce_op']}' is not a reduction torch knows"),
        (attrs["phase"] in (FORWARD, BACKWARD, "optimizer"),
         f"phase '{attrs['phase']}' is not forward, backward or optimizer"),
        (0 < len(ranks) == len(set(ranks)) and all(0 <= r < world for r in ranks),
         f"group_ranks {ranks} are not distinct ranks below the run's world_size {world}"),
        (rank is None or rank in ranks, f"group_ranks {ranks} do not hold this file's rank {rank}"),
        ((attrs["group_seq"] >= 0 or attrs["op"] in P2P_OPS) and attrs["seq"] >= 0 and attrs["bucket"] >= -1,
         "group_seq and seq must be >= 0, bucket >= -1"),
        (attrs["root"] == -1 or attrs["root"] in ranks, f"root {attrs['root']} is not a rank of its group {ranks}"),
        (all(not s or (len(s) == len(ranks) and min(s) >= 0) for s in (attrs["in_splits"], attrs["out_splits"])),
         f"split sizes {attrs['in_splits']} / {attrs['out_splits']}: expected one size >= 0 per rank of the group"),
        (attrs["call"] == "" or f"{CALLS}/{attrs['call']}" in groups, f"call '{attrs['call']}' is not a call of the "
                                                                      f"file"),
    )
    for ok, why in checks:
        if not ok:
            raise _fail(path, f"{where}: {why}")


def _check_p2p(attrs: dict[str, Any], index: int, rank, microbatches: int, path) -> None:
    where = f"collective {index} ({attrs['op']})"
    checks = (
        (attrs["microbatch"] < microbatches,
         f"microbatch {attrs['microbatch']} is not one the iteration ran (it ran {microbatches})"),
        (attrs["peer"] in attrs["group_ranks"] and attrs["peer"] != rank,
         f"peer {attrs['peer']} is not another rank of its group {attrs['group_ranks']}"),
        (attrs["group_seq"] == -1,
         f"group_seq {attrs['group_seq']}: a point-to-point op has no place on its group (-1)"),
        (min(attrs["tag"], attrs["p2p_seq"], attrs["microbatch"]) >= 0, "tag, p2p_seq and microbatch must be >= 0"),
    )
    for ok, why in checks:
        if not ok:
            raise _fail(path, f"{where}: {why}")


# -- batch_size -----------------------------------------------------------------------------------------------------
def check_batch_size(meta: dict[str, Any], datasets: dict, stats: dict[str, tuple], path) -> None:
    """`batch_size` at most the recorded batch's elements (a replay builds the model with it, first)."""
    size = meta.get("batch_size")
    if not isinstance(size, int) or size <= 1:
        return
    shapes = [d.shape for p, d in datasets.items() if p.startswith(BATCH + "/")]
    shapes += [s[4] for p, s in stats.items() if p.startswith(BATCH + "/")]
    held = sum(math.prod(s) for s in shapes)
    if held and size > held:
        raise _fail(path, f"root attribute 'batch_size' is {size}, but the recorded batch holds {held} elements "
                          f"in all (a builder makes at least one per sample)")


# -- microbatches ---------------------------------------------------------------------------------------------------
def check_microbatches(meta: dict[str, Any], groups: dict[str, tuple[dict, list]], datasets: dict, path) -> None:
    """The microbatch of every call and batch tensor is one of the iteration's (`microbatches`, absent: 1), and
    `/microbatch_loss` holds one loss per microbatch, exactly when there are several (docs/format.md)."""
    count = int(meta.get(MICROBATCHES) or 1)
    named = [(f"call group '{key}'", groups[f"{CALLS}/{key}"][0]) for key in groups.get(CALLS, ({}, []))[1]]
    named += [(f"batch tensor '/{p}'", d.attrs) for p, d in datasets.items() if p.startswith(BATCH + "/")]
    for where, attrs in named:
        value = attrs.get(MICROBATCH, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
            raise _fail(path, f"{where} has microbatch {value!r}, expected an integer from 0 to {count - 1} (the "
                              f"root attribute '{MICROBATCHES}' is {count})")
    losses = datasets.get(MICROBATCH_LOSS)
    if count > 1 and (losses is None or tuple(losses.shape) != (count,)):
        shape = "none" if losses is None else f"shape {list(losses.shape)}"
        raise _fail(path, f"/{MICROBATCH_LOSS} should hold the {count} microbatches' losses (shape [{count}]), "
                          f"got {shape}")
    if count == 1 and losses is not None:
        raise _fail(path, f"/{MICROBATCH_LOSS} is there, but the root attribute '{MICROBATCHES}' says one "
                          f"microbatch")


# -- /local and /unprobed -------------------------------------------------------------------------------------------
def check_local(rows: list[LocalRow], unprobed: list[tuple[str, int, str]], groups: dict[str, tuple[dict, list]],
                datasets: dict, params: set[str], path) -> set[tuple[str, int]]:
    """The local rows and unprobed entries checked (module docstring); returns the calls with nothing of their own
    to judge (pass-through: every recorded output is one of their inputs)."""
    calls = _calls(groups)
    seen: set[tuple] = set()
    judged: set[tuple[str, int]] = set()
    for i, row in enumerate(rows):
        _check_local_row(i, row, calls, params, path)
        if row.key in seen:
            raise _fail(path, f"/local row {i}: a second row for {_name(row)} (one row per tensor)")
        seen.add(row.key)
        judged.add((row.module, row.call))
    listed = set()
    for i, (module, call, reason) in enumerate(unprobed):
        if (module, call) not in calls and (module, call) != OPTIMIZER_CALL:
            raise _fail(path, f"/unprobed row {i} names {module}@{call}, which is no call of the file")
        if not isinstance(reason, str) or call < 0:
            raise _fail(path, f"/unprobed row {i}: expected a call >= 0 and a reason")
        listed.add((module, call))
    silent = sorted(set(calls) - judged - listed)
    passing = set()
    for module, call in silent:
        if not _passes_through(calls[(module, call)], groups, datasets):
            raise _fail(path, f"call {module}@{call} holds local data for no tensor and is not listed in /unprobed: "
                              f"its rows are missing, so the file is damaged (record the target again)")
        passing.add((module, call))
    return passing


def _calls(groups: dict[str, tuple[dict, list]]) -> dict[tuple[str, int], str]:
    keys = groups[CALLS][1] if CALLS in groups else []
    found = {}
    for key in keys:
        attrs = groups[f"{CALLS}/{key}"][0]
        found[(str(attrs["module"]) or ROOT_MODULE, int(attrs["call"]))] = key
    return found


def _name(row: LocalRow) -> str:
    return f"{row.module}@{row.call} {row.phase} {row.tensor}"


def _check_local_row(i: int, row: LocalRow, calls: dict, params: set[str], path) -> None:
    where = f"/local row {i} ({_name(row)})"
    if row.phase not in LOCAL_PHASES:
        raise _fail(path, f"{where}: phase '{row.phase}' is none of {', '.join(LOCAL_PHASES)}")
    if row.phase in (FORWARD, BACKWARD) and (row.module, row.call) not in calls:
        raise _fail(path, f"{where}: {row.module}@{row.call} is no call of the file")
    clipping = (row.module, row.call, row.phase, row.tensor) == (*OPTIMIZER_CALL, "optimizer", CLIP_ROW)
    if row.phase not in (FORWARD, BACKWARD) and not clipping:
        name = row.tensor if row.module == ROOT_MODULE else f"{row.module}.{row.tensor}"
        if name not in params or row.call != 0:
            raise _fail(path, f"{where}: '{name}' (call {row.call}) is no recorded parameter or buffer (whose rows "
                              f"have call 0)")
    if row.dtype not in _TENSOR_DTYPES:
        raise _fail(path, f"{where}: dtype '{row.dtype}' is no tensor dtype")
    _check_local_numbers(row, where, path)


def _check_local_numbers(row: LocalRow, where: str, path) -> None:
    counts = {n: getattr(row, n) for n in ("numel", "nan_ref", "inf_ref", "nan", "inf", "mismatch", "seq")}
    for name, value in counts.items():
        if not _whole(value):
            raise _fail(path, f"{where}: {name} {value!r}, expected a whole number >= 0")
    for name in ("rel_l2", "max_abs", "noise_target", "noise_reference", "noise_bound", "recipe_rel_l2", "format_cost"):
        value = getattr(row, name)
        if not (math.isnan(value) or value >= 0):
            raise _fail(path, f"{where}: {name} {value!r}, expected >= 0 (or NaN)")
    if not (math.isnan(row.cosine) or -1.0 - 1e-9 <= row.cosine <= 1.0 + 1e-9):
        raise _fail(path, f"{where}: cosine {row.cosine!r}, expected from -1 to 1")
    if row.rel_l2 > 0 and row.max_abs == 0:  # (the other way round, squares of tiny differences may underflow)
        raise _fail(path, f"{where}: rel_l2 {row.rel_l2!r} with max_abs 0: no difference, yet an error")
    if row.nan + row.inf > row.numel or row.nan_ref + row.inf_ref > row.numel:
        raise _fail(path, f"{where}: more NaN/Inf than its {row.numel} elements")
    low = max(abs(row.nan - row.nan_ref), abs(row.inf - row.inf_ref))
    high = min(row.numel, row.nan + row.nan_ref + row.inf + row.inf_ref)
    if not low <= row.mismatch <= high:
        raise _fail(path, f"{where}: mismatch {row.mismatch} with NaN {row.nan_ref}|{row.nan} and Inf "
                          f"{row.inf_ref}|{row.inf} (reference|target): expected from {low} to {high}")


def _passes_through(key: str, groups: dict[str, tuple[dict, list]], datasets: dict) -> bool:
    """Whether every output a call recorded is one of its inputs, stored once (forward: an input; backward: an
    output gradient): nothing of its own to judge."""
    for phase, inputs, outputs in ((FORWARD, ("input", "kwarg"), ("output",)),
                                   (BACKWARD, ("grad_output",), ("grad_input", "grad_kwarg"))):
        names = groups.get(f"{CALLS}/{key}/{phase}", ({}, []))[1]
        addrs = {datasets[f"{CALLS}/{key}/{phase}/{n}"].addr for n in names
                 if n.split(".", 1)[0] in inputs and f"{CALLS}/{key}/{phase}/{n}" in datasets}
        for name in names:
            stored = datasets.get(f"{CALLS}/{key}/{phase}/{name}")
            if name.split(".", 1)[0] in outputs and (stored is None or stored.addr not in addrs):
                return False
    return True


# -- /optimizer_state -----------------------------------------------------------------------------------------------
def check_optimizer_state(meta: dict[str, Any], names: list[str], params: set[str], path) -> None:
    """The optimizer's state values (`names`, under `/optimizer_state`) exist exactly when the root attribute says
    the file holds them, and each names a recorded parameter (`params`)."""
    value = meta.get(OPTIMIZER_STATE, "")
    if value in (RECORDED, LOADED) and not names:
        raise _fail(path, f"root attribute '{OPTIMIZER_STATE}' is '{value}' but the file holds no /optimizer_state: "
                          f"the optimizer's state is missing")
    if names and value not in (RECORDED, LOADED):
        raise _fail(path, f"the file holds /optimizer_state but its root attribute '{OPTIMIZER_STATE}' is "
                          f"{value!r}, expected 'recorded' or 'loaded'")
    for name in names:
        param, _, _ = name.rpartition(".")
        if param not in params:
            raise _fail(path, f"/optimizer_state/{name}: '{param}' is no parameter of the file")


def check_step_start(names: list[str], params: set[str], path, group: str = STEP_START) -> None:
    """Each parameter in `/step_start` (what the model wrote itself before the step; `group`: another group of
    parameters, such as `/step_grads`) is a recorded parameter."""
    for name in names:
        if name not in params:
            raise _fail(path, f"/{group}/{name}: no parameter of the file")


# -- a multi-step recording -----------------------------------------------------------------------------------------
def check_steps(meta: dict[str, Any], groups: dict[str, tuple[dict, list]], tables: dict[str, tuple], params: set[str],
                path, losses: dict[int, float] | None = None) -> list[int]:
    """The steps of a multi-step recording, in order (module docstring). `tables`: name -> (array, columns) of the
    signature tables present; `losses`: each step's recorded loss, which its `/signature` row must hold."""
    names = groups.get(STEPS, ({}, []))[1]
    steps = sorted(int(n) for n in names)  # names were checked to be step numbers by the walk
    if meta.get("steps") != len(steps) or not steps:
        raise _fail(path, f"root attribute 'steps' is {meta.get('steps')!r} but the file holds {len(steps)} step "
                          f"group(s) under /{STEPS}")
    for step in steps:
        held = groups[f"{STEPS}/{step}"][0].get("iteration")
        if held != step:
            raise _fail(path, f"step group '/{STEPS}/{step}' holds iteration {held!r}, expected {step}")
    for name, (array, columns) in tables.items():
        if array.shape[0] != len(steps):
            raise _fail(path, f"/{name} has {array.shape[0]} rows for {len(steps)} steps")
        check_columns(columns, array.shape[1], params, f"'{path}': /{name}")
        norms = array[:, 1:]
        if (norms < 0).any():
            raise _fail(path, f"/{name}: a norm below 0 (a norm is >= 0, or NaN/Inf when a run overflowed)")
    if SIGNATURE in tables and losses:
        for row, step in zip(tables[SIGNATURE][0], steps, strict=True):
            held = losses.get(step)
            if held is not None and not (row[0] == held or (math.isnan(row[0]) and math.isnan(held))):
                raise _fail(path, f"/{SIGNATURE}: step {step}'s loss is {row[0]!r}, but the step recorded "
                                  f"{held!r}")
    return steps
