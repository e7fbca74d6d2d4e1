"""Hostile copies of a small recording, and what reading one must do: shared by tests/format/test_mutations.py
(hypothesis, in-process) and bench/mutations.py (more examples, each in a forked child that may crash or hang).

`make_pair(folder)` records a 2-layer MLP with a dropout through the public `oneiter.Recorder`: a reference, a
replay target (local data), a plain second recording (no local data: every entry judged directly) and a
statistics-level one (`level="stats"`: a `/stats` table). A `Mutation` says what to change in a copy of one of them
(or, for `rank_names`, in a 2-rank directory made of them); `apply` writes the mutant; `check` runs `compare`,
`inspect` and the replay read path on it (`limits`: `oneiter replay --layer` too) and classifies the outcome:

- `clean`: exit 0, 1 or 2; exit 2 with exactly one line on stderr (`error: ...`); no traceback anywhere;
- `traceback`: anything else (exit 3, an exception escaping, a traceback or several lines on stderr);
- `false_match`: exit 0 from compare although the mutation changed what is judged, or forged a structure or a
  number no honest recording holds (`Mutation.must_not_match`);
- `hang`: over the time limit (`check` raises `Hang`, a BaseException, from a SIGALRM timer).

The categories after `scale_values` are the structures a reader walks (`format/consistency.py`): parents that form a
cycle, a second group for one module call, a second `/stats` row, `/stats` and `/local` numbers out of range or
contradicting each other, a call's local rows deleted, accumulated entries of a replay scaled while its local rows
stay, `/random` ops that disagree with their names or count, numbers at their limits, rank file names, and
`layouts`: a call tensor's `stride`/`storage_offset` (what a replay allocates a buffer by) of the wrong type or rank,
negative, or spanning far more elements than the tensor holds; then (base `steps`: a 3-step recording whose
optimizer held momentum from the start) the step groups, their numbering and iterations, the signature table's
shape, columns and norms, and `/optimizer_state` against its attribute.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import h5py
import numpy as np

CATEGORIES = (
    "bit_flip", "attr_value", "attr_type", "attr_missing", "delete", "to_group", "to_soft_link", "to_external_link",
    "to_string", "external_storage", "virtual", "scale_values",
    "parent_cycle", "duplicate_call", "duplicate_stats", "stats_values", "local_values", "local_deleted",
    "scale_entries", "random_ops", "limits", "rank_names", "layouts", "steps",
)
# mutations that forge what no honest recording holds, or change what is judged: compare must never say MATCH
MUST_NOT_MATCH = {"scale_values", "parent_cycle", "duplicate_call", "duplicate_stats", "stats_values", "local_values",
                  "local_deleted", "scale_entries", "rank_names", "steps"}


@dataclasses.dataclass(frozen=True)
class Mutation:
    category: str
    base: str  # "target" (replay, local data), "plain" (a second plain recording), "stats" (`level="stats"`) or
    # "steps" (a multi-step recording, compared with `Pair.steps_ref`)
    path: str = ""  # the object (dataset or group; "" the root) mutated
    attr: str = ""
    value: Any = None
    flips: tuple[int, ...] = ()  # bit positions, for bit_flip

    @property
    def judged_change(self) -> bool:
        """Judged values changed beyond any tolerance, or a forged structure or number: compare must never say
        MATCH (exit 0)."""
        return self.category in MUST_NOT_MATCH


class Pair:
    """The recordings and what is in them: `datasets`, `groups` ("" the root), `attrs` ((object path, name)),
    `judged` (what compare judges) per base ("target", "plain"), and each base file's bytes in `data`."""

    def __init__(self, ref: Path, target: Path, plain: Path, stats: Path, steps_ref: Path | None = None):
        self.ref, self.target, self.plain, self.stats, self.steps_ref = ref, target, plain, stats, steps_ref
        self.datasets: dict[str, list[str]] = {}
        self.groups: dict[str, list[str]] = {}
        self.attrs: dict[str, list[tuple[str, str]]] = {}
        self.judged: dict[str, list[str]] = {}
        self.data: dict[str, bytes] = {}

    def __repr__(self) -> str:  # hypothesis prints it in a failure report: not the file bytes
        return f"Pair({self.ref.parent})"


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Dropout(0.25))


def build(batch_size: int = 3):
    """The MLP as a model file (`tests/format/mutants.py:build`), for `oneiter replay --layer` of a mutant."""
    import torch

    model = _mlp()
    torch.manual_seed(1)
    return model, (torch.randn(batch_size, 4),), lambda out: out.square().mean()


def _record(out: Path, replay: Path | None = None, level: str = "full") -> None:
    import torch

    import oneiter

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    with oneiter.Recorder(model, out, optimizer=opt, replay=replay, name="mlp", level=level,
                          meta={"batch_size": 3}) as rec:
        opt.zero_grad(set_to_none=True)
        loss = model(rec.inputs(x)).square().mean()
        loss.backward()
        opt.step()


def _record_steps(out: Path) -> None:
    """Three steps of the MLP whose momentum SGD stepped once before: the first step's optimizer state in full."""
    import torch

    import oneiter

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    model(x).square().mean().backward()
    opt.step()

    def one_step(step):
        opt.zero_grad(set_to_none=True)
        model(rec.inputs(x)).square().mean().backward()
        opt.step()

    with oneiter.StepRecorder(model, out, optimizer=opt, name="mlp", steps=3, meta={"batch_size": 3}) as rec:
        rec.run(one_step)


def make_pair(folder: Path) -> Pair:
    folder = Path(folder)
    ref, target, plain, stats = (folder / f"{name}.h5" for name in ("ref", "target", "plain", "stats"))
    steps_ref, steps = folder / "steps_ref.h5", folder / "steps.h5"
    _record(ref)
    _record(target, replay=ref)
    _record(plain)
    _record(stats, level="stats")
    _record_steps(steps_ref)
    _record_steps(steps)  # the same run again: bit for bit the reference's
    pair = Pair(ref, target, plain, stats, steps_ref)
    for base, path in (("target", target), ("plain", plain), ("stats", stats), ("steps", steps)):
        datasets, groups, attrs, judged = _contents(path)
        pair.datasets[base], pair.groups[base], pair.attrs[base] = datasets, groups, attrs
        pair.judged[base] = judged
        pair.data[base] = path.read_bytes()
    return pair


def _contents(path: Path) -> tuple[list, list, list, list]:
    """A recording's dataset paths, group paths, (path, attribute) pairs and judged entries."""
    datasets, groups, attrs = [], [""], [("", name) for name in h5py.File(path).attrs]
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            (datasets if isinstance(obj, h5py.Dataset) else groups).append(name)
            attrs.extend((name, a) for a in obj.attrs)
        f.visititems(visit)
        # what compare judges: without local data every entry (forward, backward, parameter gradients,
        # updated parameters; the loss is shown, not judged); with local data (a replay) the calls' own
        # errors in /local: a raw entry far off whose own code is exact is drift, by design
        judged = [d for d in datasets if d.startswith(("param_grads/", "state_after/"))
                  or (d.startswith("calls/") and d.split("/")[2] in ("forward", "backward"))]
        judged = [d for d in judged if f[d].dtype.kind == "f"] if "local" not in f else [
            f"local#{i}" for i in range(len(f["local"]))]
    return datasets, groups, attrs, judged


# -- applying a mutation --------------------------------------------------------------------------------------------
def apply(pair: Pair, m: Mutation, out: Path, scratch: Path) -> Path:
    """Write the mutant of `m.base` to `out` (and any file it refers to into `scratch`); a `rank_names` mutant is
    a directory of rank files (returned)."""
    if m.category == "rank_names":
        return _rank_mutant(pair, m, out, scratch)
    data = pair.data[m.base]
    if m.category == "bit_flip":
        buf = bytearray(data)
        for bit in m.flips:
            buf[(bit // 8) % len(buf)] ^= 1 << (bit % 8)
        out.write_bytes(bytes(buf))
        return out
    out.write_bytes(data)
    with h5py.File(out, "r+") as f:
        obj = f[m.path] if m.path and m.path in f else f  # the new categories' paths name calls and rows
        edit = _EDITS.get(m.category)
        if edit is None:
            raise ValueError(m.category)
        edit(f, obj, m, pair, scratch)
    return out


def _set_attr(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    obj.attrs[m.attr] = m.value


def _delete_attr(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    del obj.attrs[m.attr]


def _delete(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    del f[m.path]


def _to_group(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    del f[m.path]
    f.create_group(m.path)


def _to_soft_link(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    del f[m.path]
    f[m.path] = h5py.SoftLink(m.value)


def _to_external_link(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    other = scratch / "other.h5"
    if not other.exists():
        shutil.copy(pair.ref, other)
    del f[m.path]
    f[m.path] = h5py.ExternalLink(str(other), m.value)


def _to_string(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    del f[m.path]
    f.create_dataset(m.path, data=m.value).attrs["dtype"] = "float32"


def _external_storage(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    raw = scratch / "raw.bin"
    if not raw.exists():
        raw.write_bytes(os.urandom(4096))
    old = obj
    shape, dtype, attrs = old.shape, old.dtype, dict(old.attrs)
    del f[m.path]
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    target = m.value or str(raw)
    new = f.create_dataset(m.path, shape=shape, dtype=dtype, external=[(target, 0, max(size, 1))])
    new.attrs.update(attrs)


def _virtual(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    old = obj
    shape, dtype, attrs = old.shape, old.dtype, dict(old.attrs)
    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
    layout[...] = h5py.VirtualSource(str(pair.ref), m.path, shape=shape)
    del f[m.path]
    f.create_virtual_dataset(m.path, layout).attrs.update(attrs)


def _scale_values(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    if m.path == "local":  # the judged local error of row `attr`
        table = obj[()]
        row = int(m.attr)
        for column in ("rel_l2", "max_abs"):
            table[column][row] = 1.0 + abs(m.value) * table[column][row]
        obj[...] = table
    else:
        values = obj[()]
        obj[...] = values * np.float32(m.value) + np.float32(1.0)  # + 1: zeros change too


# category -> its edit of the open mutant file (bit_flip works on the bytes, before HDF5 opens it)
_EDITS = {
    "attr_value": _set_attr, "attr_type": _set_attr, "attr_missing": _delete_attr, "delete": _delete,
    "to_group": _to_group, "to_soft_link": _to_soft_link, "to_external_link": _to_external_link,
    "to_string": _to_string, "external_storage": _external_storage, "virtual": _virtual,
    "scale_values": _scale_values,
}


# -- running the readers --------------------------------------------------------------------------------------------
class Hang(BaseException):
    """Raised by the SIGALRM timer: a BaseException, so no `except Exception` in oneiter can swallow it."""


def _alarm(signum, frame):
    raise Hang()


_COMMAND: list = []


def _cli(*args):
    """`oneiter ARGS` in-process (typer's CliRunner), its click command built once: a third of the time otherwise."""
    import typer.testing
    from typer.main import get_command
    from typer.testing import CliRunner

    from oneiter.cli.main import app

    if not _COMMAND:
        _COMMAND.append(get_command(app))
    build = typer.testing._get_command
    typer.testing._get_command = lambda _app: _COMMAND[0]
    try:
        return CliRunner().invoke(app, [str(a) for a in args])
    finally:
        typer.testing._get_command = build


def _classify(res) -> str:
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        return "traceback"
    if res.exit_code not in (0, 1, 2) or "Traceback" in res.output:
        return "traceback"
    if res.exit_code == 2:
        lines = res.stderr.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("error:"):
            return "traceback"
    return "clean"


def _replay_read(path: Path) -> str:
    """What `record --replay` and `oneiter replay` read from a reference: state, batch, random ops."""
    from oneiter.errors import OneIterError
    from oneiter.format.layout import IterationFile
    from oneiter.record.capture.batch import read_batch
    from oneiter.record.modes.randomness import recorded_random_ops

    try:
        with IterationFile(path) as f:
            [f.tensor(p) for p in f.state().values()]
            read_batch(f)
            recorded_random_ops(f)
            list(f.calls())
    except OneIterError:
        return "clean"
    except Exception:  # noqa: BLE001 - what the property forbids
        return "traceback"
    return "clean"


def check(pair: Pair, m: Mutation, mutant: Path, timeout: float = 20.0) -> dict[str, Any]:
    """Run compare (reference vs mutant), inspect and the replay read path; per reader its outcome and exit code."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    found: dict[str, Any] = {}
    try:
        reference = mutant.parent / "ranks" / "ref" if mutant.is_dir() else pair.ref  # rank_names: two folders
        reference = pair.steps_ref if m.base == "steps" else reference
        res = _cli("compare", reference, mutant)
        found["compare"] = _classify(res)
        found["compare_exit"] = res.exit_code
        found["compare_stderr"] = res.stderr
        if m.judged_change and res.exit_code == 0:
            found["compare"] = "false_match"
        res = _cli("inspect", mutant)
        found["inspect"] = _classify(res)
        found["inspect_exit"] = res.exit_code
        found["inspect_stderr"] = res.stderr
        found["replay_read"] = _replay_read(mutant)
        if m.category in ("limits", "layouts"):  # what a replay builds before it reads anything else
            res = _cli("replay", mutant, "--layer", "0", "--model", f"{Path(__file__).resolve()}:build")
            found["replay_layer"] = _classify(res)
            found["replay_layer_exit"] = res.exit_code
    except Hang:
        found["hang"] = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return found


def outcome(found: dict[str, Any]) -> str:
    """One word for a checked mutant: clean, traceback, false_match or hang."""
    if found.get("hang"):
        return "hang"
    kinds = [found.get(k) for k in ("compare", "inspect", "replay_read", "replay_layer")]
    for bad in ("false_match", "traceback"):
        if bad in kinds:
            return bad
    return "clean"


# -- hypothesis strategies ------------------------------------------------------------------------------------------
_ODD_VALUES = ("", "1", "False", "True", "[bold]x[/]", "\x1b[31mred", "a/b", "nan", -5, -1, 0, 1, 2**40, 1.5,
               float("nan"), float("inf"), True, False, np.array([1, 2]), np.array(["a", "b"], dtype=object))


def _text(size: int):
    """Strings HDF5 can store (no NUL, no lone surrogates), control characters and markup included."""
    from hypothesis import strategies as st

    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=size)


def strategy(pair: Pair, category: str):
    """A hypothesis strategy of `Mutation`s of one category."""
    from hypothesis import strategies as st

    bases = st.sampled_from(("target", "plain"))
    make = _STRATEGIES.get(category)
    if make is None:
        raise ValueError(category)
    return make(pair, category, bases)


def _bit_flips(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return st.builds(lambda base, flips: Mutation(category, base, flips=tuple(flips)), bases,
                     st.lists(st.integers(0, 8 * len(pair.data["plain"]) - 1), min_size=1, max_size=8))


def _attr_mutations(pair: Pair, category: str, bases):
    """attr_value (odd values of the right kinds), attr_type (values of other types) and attr_missing."""
    from hypothesis import strategies as st

    def attrs(base):
        pick = st.sampled_from(pair.attrs[base])
        if category == "attr_missing":
            return pick.map(lambda pa: Mutation(category, base, pa[0], pa[1]))
        values = st.sampled_from(_ODD_VALUES) if category == "attr_type" else st.one_of(
            st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True),
            _text(12), st.booleans())
        return st.builds(lambda pa, v: Mutation(category, base, pa[0], pa[1], v), pick, values)
    return bases.flatmap(attrs)


def _deletions(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return bases.flatmap(lambda base: st.sampled_from(
        [p for p in pair.datasets[base] + pair.groups[base] if p]).map(lambda p: Mutation(category, base, p)))


def _to_groups(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return bases.flatmap(lambda base: st.sampled_from(pair.datasets[base]).map(
        lambda p: Mutation(category, base, p)))


def _soft_links(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    def soft(base):
        targets = st.sampled_from(["/nowhere", "/", "/calls", "/loss", "/batch/input.0", "../x", "/state_before"])
        return st.builds(lambda p, t: Mutation(category, base, p, value=t),
                         st.sampled_from(pair.datasets[base]), targets)
    return bases.flatmap(soft)


def _external_links(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return bases.flatmap(lambda base: st.builds(
        lambda p, t: Mutation(category, base, p, value=t), st.sampled_from(pair.datasets[base]),
        st.sampled_from(["loss", "/batch/input.0", "/nowhere"])))


def _strings(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return bases.flatmap(lambda base: st.builds(
        lambda p, t: Mutation(category, base, p, value=t), st.sampled_from(pair.datasets[base]),
        _text(20)))


def _tensors(pair: Pair, base: str) -> list[str]:
    return [p for p in pair.datasets[base] if p.startswith(("batch/", "state_before/", "calls/", "param_grads/"))]


def _external_storages(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return bases.flatmap(lambda base: st.builds(
        lambda p, t: Mutation(category, base, p, value=t), st.sampled_from(_tensors(pair, base)),
        st.sampled_from(["", "/etc/passwd"])))


def _virtuals(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return bases.flatmap(
        lambda base: st.sampled_from(_tensors(pair, base)).map(lambda p: Mutation(category, base, p)))


def _scalings(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    def scale(base):
        def make(p, k):
            if p.startswith("local#"):
                return Mutation(category, base, "local", p.partition("#")[2], k)
            return Mutation(category, base, p, value=k)
        return st.builds(make, st.sampled_from(pair.judged[base]), st.sampled_from([1000.0, -1000.0, 1e6]))
    return bases.flatmap(scale)


# category -> its strategy, given the pair, the category and the strategy of the base recording
_STRATEGIES = {
    "bit_flip": _bit_flips, "attr_value": _attr_mutations, "attr_type": _attr_mutations,
    "attr_missing": _attr_mutations, "delete": _deletions, "to_group": _to_groups, "to_soft_link": _soft_links,
    "to_external_link": _external_links, "to_string": _strings, "external_storage": _external_storages,
    "virtual": _virtuals, "scale_values": _scalings,
}


# -- the structures a reader walks (`format/consistency.py`) --------------------------------------------------------
def _calls_of(f) -> list[str]:
    return sorted(f["calls"])


def _parent_cycle(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """m.path: a call; m.value: the call made its parent (itself, or one whose parent is made this call)."""
    f[f"calls/{m.path}"].attrs["parent"] = m.value
    if m.value != m.path:
        f[f"calls/{m.value}"].attrs["parent"] = m.path
    if "unprobed" in f and m.attr == "unprobed":  # listed as unprobed too: a reader walks its parents
        old = f["unprobed"][()]
        module, _, call = m.path.rpartition("@")
        row = np.array([(module.encode(), int(call), b"forged")], dtype=old.dtype)
        del f["unprobed"]
        f.create_dataset("unprobed", data=np.concatenate([old, row]))


def _duplicate_call(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """The call m.path's output changed x100, and the reference's group for it copied in under another name
    (m.value), its `module` and `call` attributes kept."""
    out = f"calls/{m.path}/forward/output"
    if out in f:
        f[out][...] = f[out][()] * np.float32(100.0) + np.float32(1.0)
    with h5py.File(pair.ref, "r") as ref:
        ref.copy(f"calls/{m.path}", f["calls"], name=m.value)


def _duplicate_stats(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """A second /stats row for row m.value's entry, its values x1000 and a new checksum, before the original."""
    table = f["stats"][()]
    i = int(m.value) % len(table)
    row = table[i].copy()
    for name in ("min", "max", "mean", "l2", "abs_sum"):
        row[name] = row[name] * 1000.0 + 1.0
    row["checksum0"] += 1
    del f["stats"]
    f.create_dataset("stats", data=np.concatenate([table[:i], [row], table[i:]]))


def _set_row(table_name: str):
    def edit(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
        """Row m.path (an index) of a table: each column of m.value (a dict) set."""
        table = f[table_name][()]
        i = int(m.path) % len(table)
        for column, value in m.value:
            table[column][i] = value
        f[table_name][...] = table
    return edit


def _delete_local_rows(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """Every /local row of call m.path deleted (it is not listed in /unprobed), its forward output times m.value."""
    module, _, call = m.path.rpartition("@")
    table = f["local"][()]
    keep = table[[not (r["module"].decode() == module and int(r["call"]) == int(call)) for r in table]]
    del f["local"]
    f.create_dataset("local", data=keep)
    out = f"calls/{m.path}/forward/output"
    if out in f:
        f[out][...] = f[out][()] * np.float32(m.value)


def _scale_entry(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """An accumulated entry of a replay (its local rows untouched) times m.value."""
    f[m.path][...] = f[m.path][()] * np.float32(m.value)


def _random_edit(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """/random: m.attr `num_ops` or `op` (of the first op) set to m.value, or `delete` the first op."""
    group = f["random"]
    first = sorted(group)[0]
    if m.attr == "num_ops":
        group.attrs["num_ops"] = m.value
    elif m.attr == "op":
        group[first].attrs["op"] = m.value
    else:
        del group[first]


def _root_limit(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    f.attrs[m.attr] = m.value


def _steps_edit(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """A multi-step recording's structures (m.attr the kind, m.value its value): see `STEPS_MUTATIONS`."""
    _STEPS_EDITS[m.attr](f, m.value, pair)


def _signature_edit(f, value, pair: Pair) -> None:
    table = f["signature"][()]
    del f["signature"]
    column = np.arange(table.shape[1])
    new = {"rows": table[:-1], "float32": table.astype(np.float32), "flat": table.reshape(-1),
           "negative": np.where(np.arange(table.size).reshape(table.shape) == table.shape[1] + 2, -1.0, table),
           "loss": table * np.where(column == 0, 1000.0, 1.0),
           "scaled": table * np.where(column == 1, 1000.0, 1.0)}[value]
    f.create_dataset("signature", data=new).attrs["columns"] = np.array(_columns(pair), dtype=h5py.string_dtype())


def _columns_edit(f, value, pair: Pair) -> None:
    columns = list(_columns(pair))
    columns = {"swap": [columns[0], columns[2], columns[1], *columns[3:]], "drop": columns[:-1],
               "rename": [columns[0], "grad:nowhere", *columns[2:]]}[value]
    f["signature"].attrs["columns"] = np.array(columns, dtype=h5py.string_dtype())


def _optimizer_rename(f, value, pair: Pair) -> None:
    group = f["steps/0/optimizer_state"]
    group.move(sorted(group)[0], value)


_STEPS_EDITS = {
    "steps_attr": lambda f, v, _p: f.attrs.__setitem__("steps", v),
    "rename_step": lambda f, v, _p: f.move("steps/1", f"steps/{v}"),
    "iteration": lambda f, v, _p: f["steps/1"].attrs.__setitem__("iteration", v),
    "step_attr": lambda f, v, _p: f["steps/1"].attrs.__setitem__(v[0], v[1]),
    "nested": lambda f, v, _p: f.create_group("steps/1/steps/0"),
    "signature": _signature_edit, "columns": _columns_edit,
    "optimizer_missing": lambda f, v, _p: f.__delitem__("steps/0/optimizer_state"),
    "optimizer_rename": _optimizer_rename,
    "optimizer_value": lambda f, v, _p: f["steps/0"].attrs.__setitem__("optimizer_state", v),
}


def _columns(pair: Pair) -> list[str]:
    with h5py.File(pair.steps_ref, "r") as f:
        return [c.decode() if isinstance(c, bytes) else str(c) for c in f["signature"].attrs["columns"]]


def _layout(f, obj, m: Mutation, pair: Pair, scratch: Path) -> None:
    """A call tensor's layout attributes: m.value is (stride, storage_offset), None leaving that one out."""
    for name, value in zip(("stride", "storage_offset"), m.value, strict=True):
        if value is not None:
            obj.attrs[name] = value


_EDITS.update({
    "layouts": _layout,
    "parent_cycle": _parent_cycle, "duplicate_call": _duplicate_call, "duplicate_stats": _duplicate_stats,
    "stats_values": _set_row("stats"), "local_values": _set_row("local"), "local_deleted": _delete_local_rows,
    "scale_entries": _scale_entry, "random_ops": _random_edit, "limits": _root_limit, "steps": _steps_edit,
})


# -- rank files: a 2-rank run made of the single-process recordings ------------------------------------------------
def rank_dirs(pair: Pair, folder: Path) -> tuple[Path, Path]:
    """`ref/ref.rank{0,1}.h5` (the reference, as ranks 0 and 1 of 2) and `tgt/tgt.rank{0,1}.h5` (the replay)."""
    import shutil

    made = []
    for name, source in (("ref", pair.ref), ("tgt", pair.target)):
        where = folder / name
        where.mkdir(parents=True, exist_ok=True)
        for rank in (0, 1):
            path = where / f"{name}.rank{rank}.h5"
            shutil.copy(source, path)
            with h5py.File(path, "r+") as f:
                f.attrs["rank"], f.attrs["world_size"] = rank, 2
        made.append(where)
    return made[0], made[1]


def _rank_mutant(pair: Pair, m: Mutation, out: Path, scratch: Path) -> Path:
    """A copy of the 2-rank target directory with m.attr done to it: `extra` (tgt.rank0.h5 diverged, a clean
    copy named m.value beside it), `rank_attr` (rank 1's file says rank m.value), `world` (rank 1's file says
    world_size m.value), or `rename` (rank 1's file renamed m.value)."""
    import shutil

    _, tgt = rank_dirs(pair, scratch / "ranks")
    folder = out.with_suffix("")
    shutil.rmtree(folder, ignore_errors=True)  # hypothesis runs every example in one test's folder
    shutil.copytree(tgt, folder)
    one = folder / "tgt.rank1.h5"
    if m.attr == "extra":
        shutil.copy(folder / "tgt.rank0.h5", folder / m.value)
        with h5py.File(folder / "tgt.rank0.h5", "r+") as f:
            f["calls/0@0/forward/output"][...] = f["calls/0@0/forward/output"][()] * np.float32(100.0)
    elif m.attr in ("rank_attr", "world"):
        with h5py.File(one, "r+") as f:
            f.attrs["rank" if m.attr == "rank_attr" else "world_size"] = m.value
    else:
        one.rename(folder / m.value)
    return folder


def _cycles(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    calls = [g.split("/")[1] for g in pair.groups["target"] if g.count("/") == 1 and g.startswith("calls/")]

    def make(call, other, unprobed):
        return Mutation(category, "target", call, "unprobed" if unprobed else "", other)
    return st.builds(make, st.sampled_from(calls), st.sampled_from(calls), st.booleans())


def _duplicates(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    calls = [g.split("/")[1] for g in pair.groups["plain"] if g.count("/") == 1 and g.startswith("calls/")]
    return st.builds(lambda base, call, name: Mutation(category, base, call, value=f"{name}@0"), bases,
                     st.sampled_from(calls), st.sampled_from(["zz", "copy", "a.b"]))


def _stats_duplicates(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return st.builds(lambda i: Mutation(category, "stats", value=i), st.integers(0, 200))


_STATS_FORGED = (  # (column, value) sets no honest /stats row holds
    (("numel", float("inf")),), (("numel", -1.0),), (("numel", 2.5),), (("numel", 1e30),), (("nan", -1.0),),
    (("inf", 1e9),), (("l2", float("inf")),), (("l2", -1.0),), (("abs_sum", float("nan")),),
    (("min", float("inf")),), (("max", float("-inf")),), (("min", 5.0), ("max", 1.0)), (("shape", b"-1,3"),),
    (("shape", b"99999999999999999999999"),),
)
_LOCAL_FORGED = (  # (column, value) sets no honest /local row holds
    (("rel_l2", -1.0),), (("rel_l2", float("-inf")),), (("max_abs", -1.0),), (("cosine", 2.0),),
    (("nan", 100), ("nan_ref", 0), ("mismatch", 0)), (("inf", 5), ("mismatch", -5)), (("numel", -1),),
    (("mismatch", 10**9),), (("noise_target", -1.0),), (("noise_target", 10.0), ("rel_l2", 1.0)),
    (("noise_target", 10.0), ("rel_l2", 1.0), ("max_abs", 1.0)), (("module", b"nowhere"),), (("call", 7),),
    (("phase", b"sideways"),), (("dtype", b"float99"),), (("seq", -3),),
    (("noise_reference", float("inf")), ("noise_target", float("inf")), ("rel_l2", 0.5), ("max_abs", 0.5)),
)


def _row_sets(base: str, forged: tuple):
    def strategy(pair: Pair, category: str, bases):
        from hypothesis import strategies as st

        return st.builds(lambda i, cols: Mutation(category, base, str(i), value=cols), st.integers(0, 200),
                         st.sampled_from(forged))
    return strategy


def _deleted_rows(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    calls = [g.split("/")[1] for g in pair.groups["target"] if g.count("/") == 1 and g.startswith("calls/")]
    return st.builds(lambda call, k: Mutation(category, "target", call, value=k), st.sampled_from(calls),
                     st.sampled_from([1.5, 3.0, 1000.0]))


def _entry_scalings(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    entries = [d for d in pair.datasets["target"] if d.startswith(("param_grads/", "state_after/", "calls/"))
               and "/backward/" not in d and ("/forward/output" in d or not d.startswith("calls/"))]
    return st.builds(lambda p, k: Mutation(category, "target", p, value=k), st.sampled_from(entries),
                     st.sampled_from([1.5, 3.0, 1000.0, -1.0]))


def _random_mutations(pair: Pair, category: str, bases):
    """The plain recording's /random (a replay draws no values of its own: it holds none)."""
    from hypothesis import strategies as st

    values = st.one_of(
        st.tuples(st.just("num_ops"), st.sampled_from([2**62, 2**31, 0, 7, -1])),
        st.tuples(st.just("op"), st.sampled_from(["aten.native_dropout.default", "aten.add.Tensor", "x",
                                                  "aten.randperm.default"])),
        st.tuples(st.just("delete"), st.just(None)))
    return st.builds(lambda av: Mutation(category, "plain", "random", av[0], av[1]), values)


def _limits(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    values = st.sampled_from([("batch_size", 2**31), ("batch_size", 2**62), ("world_size", 2**40),
                              ("num_calls", 2**62), ("num_random_ops", 2**62), ("rank", 2**40), ("seed", 2**62)])
    return st.builds(lambda base, av: Mutation(category, base, "", av[0], av[1]), bases, values)


def _rank_names(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    values = st.sampled_from([("extra", "tgt.rank00.h5"), ("extra", "tgt.rank01.h5"),
                              ("extra", "tgt.rank99999999999999999999.h5"), ("rank_attr", 0), ("rank_attr", 5),
                              ("world", 2**40), ("world", 1), ("world", 3), ("rename", "tgt.rank2.h5"),
                              ("rename", "tgt.rank1000000000.h5")])
    return st.builds(lambda av: Mutation(category, "target", "", av[0], av[1]), values)


def _layouts(pair: Pair, category: str, bases):
    """Layouts no honest recording holds, on the first call's forward tensors (shape (3, 4) or (3, 8), ...)."""
    from hypothesis import strategies as st

    tensors = [d for d in pair.datasets["plain"] if d.startswith("calls/") and "/forward/" in d]
    values = st.sampled_from([([2**40, 1], 0), ([1, 2**40], 0), ([-1, 1], 0), ([1], 0), ([1, 1, 1], 0),
                              ([1.5, 1], 0), ("x", 0), ([4, 1], 2**62), ([4, 1], -3), ([4, 1], "0"), ([4, 1], None),
                              (None, 0), ([4, 1], 2**31)])
    return st.builds(lambda p, v: Mutation(category, "plain", p, value=v), st.sampled_from(tensors), values)


_STRATEGIES.update({
    "layouts": _layouts,
    "parent_cycle": _cycles, "duplicate_call": _duplicates, "duplicate_stats": _stats_duplicates,
    "stats_values": _row_sets("stats", _STATS_FORGED), "local_values": _row_sets("target", _LOCAL_FORGED),
    "local_deleted": _deleted_rows, "scale_entries": _entry_scalings, "random_ops": _random_mutations,
    "limits": _limits, "rank_names": _rank_names,
})

# (kind, value) of the multi-step mutations: every one is refused when the file is opened, but `scaled` (a
# parameter's gradient norm x1000 in every step, which no statistic contradicts: a comparison that must not match)
STEPS_MUTATIONS = (
    ("steps_attr", 2), ("steps_attr", 5), ("steps_attr", 0), ("steps_attr", -1), ("steps_attr", 2**40),
    ("steps_attr", "3"), ("rename_step", "x"), ("rename_step", "7"), ("rename_step", "0001"), ("iteration", 2),
    ("iteration", -1), ("iteration", "1"), ("step_attr", ("complete", False)), ("step_attr", ("steps", 3)),
    ("step_attr", ("schema_version", 99)), ("nested", None), ("signature", "rows"), ("signature", "float32"),
    ("signature", "flat"), ("signature", "negative"), ("signature", "loss"), ("signature", "scaled"),
    ("columns", "swap"),
    ("columns", "drop"), ("columns", "rename"), ("optimizer_missing", None),
    ("optimizer_rename", "nowhere.weight.momentum_buffer"), ("optimizer_rename", "0.weight.9x"),
    ("optimizer_value", "empty"), ("optimizer_value", "not recorded"),
)


def _steps_mutations(pair: Pair, category: str, bases):
    from hypothesis import strategies as st

    return st.sampled_from(STEPS_MUTATIONS).map(lambda kv: Mutation(category, "steps", "", kv[0], kv[1]))


_STRATEGIES["steps"] = _steps_mutations
