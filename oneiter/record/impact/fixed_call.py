"""The calls fixed in one impact run: which call of a module this is, what its live forward called, its fix applied.

Where this sits: an impact run (`impact_pass.py`) enters `Fixes(model, targets, replayer)` around the iteration it
runs again; `targets` are the (module path, call index) pairs to fix. Hooks on each fixed module count its calls; on
a fixed one the call runs live as usual (its children's calls noted: which modules, the dtypes and devices of their
floating inputs, the call index of each fixed one), and when it returns its output is replaced by its float64
recomputation on the trusted path (`float64.py`), which also gives its input gradients in backward.

Every module's `forward` is routed for the run (`_route`): in the run's own code a call goes straight to its forward
(and is noted by every fixed call whose live forward is running); in a fixed call's float64 code a call is a child of
that code and runs live (`float64.live_child`), unless it is fixed in this run too — then it runs in float64 as part
of the recomputation (its own parameters cast as well), which fixes both. Calls inside a live child are the run's own
code again: a fixed call there is fixed as in the live forward, its call index the one it had there.

Calls made while autograd runs a backward (activation checkpointing's recomputation) are left alone: a fixed call
inside a checkpointed region is fixed in forward only, and its recomputation may not match (not supported).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from oneiter.errors import OneIterError
from oneiter.format.schema import BACKWARD, FORWARD
from oneiter.record.capture.recompute import in_backward
from oneiter.record.impact.float64 import (
    FixRecord,
    Unfixable,
    fixed_output,
    float64_copy,
    in_float64,
    live_child,
    live_mode,
    moved_forward,
    trusted_path,
    write_back,
)
from oneiter.record.modes import trusted
from oneiter.record.modes.randomness import RandomReplayer
from oneiter.runtime import host_random
from oneiter.runtime.names import module_paths
from oneiter.runtime.precision import FLAG_FACTOR

__all__ = ["Fixes", "FIXED"]

FIXED = ""  # `Fixes.done`'s value for a call that was fixed (else: why it was not)


@dataclass
class _Entry:
    """A module call a fixed call's live forward made: the module, its floating inputs' (dtype, device), and its call
    index when it is a fixed module."""

    module: int
    dtypes: list
    index: int | None


class _Counter:
    """Call indices in the run's own code: each fixed module's calls, counted."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def take(self, module) -> int | None:
        index = self.counts.get(id(module), 0)
        self.counts[id(module)] = index + 1
        return index

    def entry(self, module) -> _Entry | None:
        return None


class _Log:
    """The calls one fixed call's live forward made, in order: its float64 rerun makes them again in that order."""

    def __init__(self, entries: list[_Entry]):
        self.entries, self.at = entries, 0

    def entry(self, module) -> _Entry | None:
        for k in range(self.at, len(self.entries)):
            if self.entries[k].module == id(module):
                self.at = k + 1
                return self.entries[k]
        return None

    def take(self, module) -> int | None:
        found = self.entry(module)
        return None if found is None else found.index


@dataclass
class _Frame:
    """A fixed call whose live forward is running: what its recomputation starts from."""

    module: Any
    key: tuple[str, int]
    copies: list  # float64 copies of its flattened inputs, taken when it began
    in_spec: Any
    versions: list
    buffers: list  # (live buffer, its value when the call began) of every buffer under the module
    random_begin: int
    rng: Any
    host: Any
    seq: list[_Entry] = field(default_factory=list)
    entered: bool = False
    copies_dtype: Any = torch.float32  # its first floating input's dtype (a live child's when nothing else says)


@dataclass
class _Call:
    """A call the float64 code of a fixed call made, as it is in progress."""

    module: Any
    entry: _Entry | None
    fixed: bool
    pause: Any  # the trusted path paused while a live child (its hooks too) runs; None: it runs in float64


@dataclass
class _World:
    """Where module calls happen now: the run's own code (`live`) or a fixed call's float64 code (`f64`)."""

    kind: str
    source: Any  # _Counter (the run itself) or _Log (inside a recomputation)
    replayer: Any  # the random-op replayer of this code
    frames: list[_Frame] = field(default_factory=list)
    frame: _Frame | None = None  # f64: the call being recomputed
    record: FixRecord | None = None
    anchor64: Any = None
    autocast: Any = None
    owner: Any = None  # the `Fixes`
    calls: list = field(default_factory=list)  # f64: the calls of its code in progress, (module, entry, fixed, pause)

    @property
    def device(self):
        return self.owner.device

    @contextmanager
    def live_child(self) -> Iterator[None]:
        """A live child of this float64 code: the run's own code again, its fixed calls indexed from this log."""
        self.owner.worlds.append(_World("live", self.source, self.replayer, owner=self.owner))
        try:
            with live_mode(self.replayer, self.autocast):
                yield
        finally:
            self.owner.worlds.pop()


class Fixes:
    """Fix the calls `targets` ((module path, call index), paths as files name them) in the run the block holds.

    `replayer`: the run's random-op replayer (a fixed call's recomputation replays the random values its live call
    drew). `expected[(path, index)]`: (phase, tensor, rel_l2) of the call's flagged own error: where that is its own
    outputs (or input gradients), a fix that moves them by less than `FLAG_FACTOR` times less did not remove it — its
    trusted recomputation runs the same wrong code (a difference in the model's own Python, which runs in float64
    too) — and the call counts as not fixed. After the block, `done[(path, index)]` is `FIXED` or why the call was
    not fixed; a target missing there never ran."""

    def __init__(self, model, targets: Iterable[tuple[str, int]], replayer=None, expected: dict | None = None):
        self.model = model
        modules = dict(module_paths(model))
        self.wanted: dict[int, set[int]] = {}
        self.paths: dict[int, str] = {}
        for path, index in targets:
            module = modules.get(path if path != "(root)" else "")
            if module is None:
                raise OneIterError(f"impact fixes {path}@{index}, but this model has no module '{path}' (the calls "
                                   f"to fix come from another model's recording?)", param="impact_from")
            self.wanted.setdefault(id(module), set()).add(index)
            self.paths[id(module)] = path
        self.done: dict[tuple[str, int], str] = {}
        self.expected = dict(expected or {})
        self.device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        self.worlds = [_World("live", _Counter(), replayer, owner=self)]
        self._pending: dict[int, int | None] = {}
        self._origs: dict[int, Any] = {}
        self._handles: list = []
        self._patched: list = []

    # -- the block --------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Fixes":
        modules = [m for _, m in self.model.named_modules(remove_duplicate=True)]
        for module in modules:
            self._patch(module)
            if id(module) in self.wanted:
                self._handles.append(module.register_forward_pre_hook(self._before, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._after, with_kwargs=True))
        for module in modules:  # around every other hook: a call of float64 code decided, its hooks live or not
            self._handles.append(module.register_forward_pre_hook(self._enter_call, with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(self._leave_call, with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for module, had, previous in reversed(self._patched):
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._handles, self._patched = [], []

    def _patch(self, module) -> None:
        had, previous = "forward" in module.__dict__, module.__dict__.get("forward")
        orig = module.forward

        def forward(*args, **kwargs):
            return self._route(module, orig, args, kwargs)

        try:
            module.forward = forward
        except (AttributeError, TypeError):  # a module that refuses attributes (TorchScript): left as it is
            return
        self._origs[id(module)] = orig
        self._patched.append((module, had, previous))

    # -- every call -------------------------------------------------------------------------------------------------
    def _route(self, module, orig, args: tuple, kwargs: dict):
        world = self.worlds[-1]
        if in_backward():
            return orig(*args, **kwargs)
        if world.kind == "live":
            index = self._pending.pop(id(module), None)
            for frame in world.frames:
                if frame.module is module and not frame.entered:
                    frame.entered = True  # the fixed call's own call
                    continue
                frame.seq.append(_Entry(id(module), _dtypes(args, kwargs), index))
            return orig(*args, **kwargs)
        assert world.frame is not None and world.record is not None  # an f64 world recomputes one call
        call = world.calls[-1] if world.calls and world.calls[-1].module is module else None
        entry = call.entry if call is not None else None  # a call of the float64 code: a child of the recomputed one
        if call is not None and call.fixed:
            assert entry is not None  # fixed: a call of the live forward (`_enter_call`)
            with in_float64(module, _called(world.frame), world.record):
                self.done[(self.paths[id(module)], entry.index)] = FIXED  # fixed as part of the recomputation
                return orig(*args, **kwargs)
        fallback = next((p.dtype for p in module.parameters() if p.is_floating_point()), world.frame.copies_dtype)
        return live_child(orig, module, entry.dtypes if entry is not None else None, args, kwargs, world=world,
                          anchor64=world.anchor64, fallback_dtype=(fallback, self.device))

    def _enter_call(self, module, args: tuple, kwargs: dict) -> None:
        """A call the float64 code makes: which one of the live forward it is, whether it is fixed too (it then runs
        in float64 as part of the recomputation) or runs live — its hooks too (`--inject-fault`'s stand for the
        device's kernels: they apply to a live child), the trusted path paused until it returns."""
        world = self.worlds[-1]
        if in_backward() or world.kind != "f64":
            return
        entry = world.source.entry(module)
        index = entry.index if entry is not None else None
        fixed = index is not None and index in self.wanted.get(id(module), ())
        pause = None
        if not fixed:
            pause = trusted.paused()
            pause.__enter__()
        world.calls.append(_Call(module, entry, fixed, pause))

    def _leave_call(self, module, args: tuple, kwargs: dict, output) -> None:
        world = self.worlds[-1]
        if world.kind != "f64" or not world.calls or world.calls[-1].module is not module:
            return
        call = world.calls.pop()
        if call.pause is not None:
            call.pause.__exit__(None, None, None)

    def _before(self, module, args: tuple, kwargs: dict) -> None:
        world = self.worlds[-1]
        if in_backward() or world.kind != "live":
            return
        index = world.source.take(module)
        self._pending[id(module)] = index
        if index is None or index not in self.wanted[id(module)]:
            return
        world.frames.append(self._frame(module, index, args, kwargs, world))

    def _frame(self, module, index: int, args: tuple, kwargs: dict, world: _World) -> _Frame:
        leaves, spec = tree_flatten((args, kwargs))
        memo: dict[int, Any] = {}
        copies = [memo.setdefault(id(v), float64_copy(v)) if isinstance(v, torch.Tensor) else v for v in leaves]
        versions = [v._version if isinstance(v, torch.Tensor) else None for v in leaves]
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        first = next((v.dtype for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()), torch.float32)
        return _Frame(module, (self.paths[id(module)], index), copies, spec, versions, buffers,
                      world.replayer.num_ops if world.replayer is not None else 0, torch.get_rng_state(),
                      host_random.state(), copies_dtype=first)

    def _after(self, module, args: tuple, kwargs: dict, output):
        world = self.worlds[-1]
        if in_backward() or world.kind != "live" or not world.frames or world.frames[-1].module is not module:
            return None
        frame = world.frames.pop()
        leaves, _ = tree_flatten((args, kwargs))
        after = [(b, b.detach().clone()) for b, _ in frame.buffers]  # as the live call left them
        try:
            if any(isinstance(v, torch.Tensor) and v._version != old for v, old in zip(leaves, frame.versions,
                                                                                       strict=True)):
                raise Unfixable("it writes an input in place")
            _restore(frame.buffers)  # its recomputation runs the call again
            phase, tensor, own = self.expected.get(frame.key, ("", "", 0.0))
            check = self._checker(frame.key, own) if phase == BACKWARD and tensor.startswith("grad_") else None
            fixed = fixed_output(_Compute(self, frame, world), tuple(leaves), output, check)
        except Exception as err:  # noqa: BLE001 - the call stays as it ran; the table says why
            _restore(after)
            self.done[frame.key] = f"not fixed: {_first_line(err)}"
            return None
        self.done[frame.key] = FIXED
        if phase == FORWARD and tensor.startswith("output"):
            self._checker(frame.key, own)(moved_forward(output, fixed))
        return fixed

    def _checker(self, key: tuple[str, int], own: float):
        """What tells whether a fix moved the call's own values by anything like its own error."""
        def check(moved: float) -> None:
            if own > 0 and moved < own / FLAG_FACTOR and self.done.get(key) == FIXED:
                self.done[key] = (f"not fixed: its float64 recomputation gives what it computed (moved by "
                                  f"{moved:.1e}, its own error {own:.1e}): the difference is in code the trusted "
                                  f"path runs too (the model's own Python), which no kernel fix removes")
        return check

    def push_f64(self, frame: _Frame, replayer, record: FixRecord, anchor64, autocast) -> _World:
        world = _World("f64", _Log(frame.seq), replayer, frame=frame, record=record, anchor64=anchor64,
                       autocast=autocast, owner=self)
        self.worlds.append(world)
        return world


class _Compute:
    """The float64 recomputation of one fixed call (what `float64.fixed_output` runs inside its autograd node)."""

    def __init__(self, fixes: Fixes, frame: _Frame, world: _World):
        self.fixes, self.frame, self.world = fixes, frame, world
        self.copies = frame.copies
        replayer = world.replayer
        self.replayer = None if replayer is None else RandomReplayer(
            replayer.reader, replayer.device, ops=replayer.ops[frame.random_begin:replayer.num_ops],
            replay=replayer.replay)
        kind = fixes.device.type
        self.autocast = (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None

    def __call__(self, leaves64: list):
        args, kwargs = tree_unflatten(leaves64, self.frame.in_spec)
        record = FixRecord()
        anchor64 = torch.zeros((), dtype=torch.float64, requires_grad=True)
        module = self.frame.module
        self.fixes.push_f64(self.frame, self.replayer, record, anchor64, self.autocast)
        try:
            with trusted_path(self.frame, self.replayer, self.fixes.device.type), \
                    in_float64(module, _called(self.frame), record):
                out = self.fixes._origs.get(id(module), module.forward)(*args, **kwargs)
        finally:
            self.fixes.worlds.pop()
        write_back(record)
        return out, record, anchor64


def _called(frame: _Frame) -> set[int]:
    """The modules a fixed call's live forward called (their parameters are theirs, not its own code's)."""
    return {e.module for e in frame.seq}


def _dtypes(args: tuple, kwargs: dict) -> list:
    leaves, _ = tree_flatten((args, kwargs))
    return [(v.dtype, v.device) for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _restore(buffers: list) -> None:
    with torch.no_grad():
        for live, value in buffers:
            live.data.copy_(value)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
