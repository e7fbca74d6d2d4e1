"""Hostile copies of a small recording, and what reading one must do: shared by tests/format/test_mutations.py
(hypothesis, in-process) and bench/mutations.py (more examples, each in a forked child that may crash or hang).

`make_pair(folder)` records a 2-layer MLP through the public `oneiter.Recorder`: a reference, a replay target
(local data) and a plain second recording (no local data: every entry judged directly). A `Mutation` says what to
change in a copy of one of them; `apply` writes the mutant; `check` runs `compare`, `inspect` and the replay read
path on it and classifies the outcome:

- `clean`: exit 0, 1 or 2; exit 2 with exactly one line on stderr (`error: ...`); no traceback anywhere;
- `traceback`: anything else (exit 3, an exception escaping, a traceback or several lines on stderr);
- `false_match`: exit 0 from compare although judged values were changed beyond any tolerance;
- `hang`: over the time limit (`check` raises `Hang`, a BaseException, from a SIGALRM timer).
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
)


@dataclasses.dataclass(frozen=True)
class Mutation:
    category: str
    base: str  # "target" (replay, local data) or "plain" (a second plain recording)
    path: str = ""  # the object (dataset or group; "" the root) mutated
    attr: str = ""
    value: Any = None
    flips: tuple[int, ...] = ()  # bit positions, for bit_flip

    @property
    def judged_change(self) -> bool:
        """Judged values changed beyond any tolerance: compare must never say MATCH (exit 0)."""
        return self.category == "scale_values"


class Pair:
    """The recordings and what is in them: `datasets`, `groups` ("" the root), `attrs` ((object path, name)),
    `judged` (what compare judges) per base ("target", "plain"), and each base file's bytes in `data`."""

    def __init__(self, ref: Path, target: Path, plain: Path):
        self.ref, self.target, self.plain = ref, target, plain
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
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _record(out: Path, replay: Path | None = None) -> None:
    import torch

    import oneiter

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    with oneiter.Recorder(model, out, optimizer=opt, replay=replay, name="mlp") as rec:
        opt.zero_grad(set_to_none=True)
        loss = model(rec.inputs(x)).square().mean()
        loss.backward()
        opt.step()


def make_pair(folder: Path) -> Pair:
    folder = Path(folder)
    ref, target, plain = folder / "ref.h5", folder / "target.h5", folder / "plain.h5"
    _record(ref)
    _record(target, replay=ref)
    _record(plain)
    pair = Pair(ref, target, plain)
    for base, path in (("target", target), ("plain", plain)):
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
    """Write the mutant of `m.base` to `out` (and any file it refers to into `scratch`)."""
    data = pair.data[m.base]
    if m.category == "bit_flip":
        buf = bytearray(data)
        for bit in m.flips:
            buf[(bit // 8) % len(buf)] ^= 1 << (bit % 8)
        out.write_bytes(bytes(buf))
        return out
    out.write_bytes(data)
    with h5py.File(out, "r+") as f:
        obj = f[m.path] if m.path else f
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
    from oneiter.record.batch import read_batch
    from oneiter.record.randomness import recorded_random_ops

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
        res = _cli("compare", pair.ref, mutant)
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
    kinds = [found.get(k) for k in ("compare", "inspect", "replay_read")]
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
