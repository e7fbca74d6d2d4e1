"""Activation checkpointing: a module call that runs again during backward is a recomputation, not a new call.

Where this sits: `capture.ModuleCapture` reports every forward call here, and asks `in_backward()` in its hooks:
a module called while autograd runs a backward is being *recomputed* by activation checkpointing
(`torch.utils.checkpoint`, Hugging Face's `gradient_checkpointing_enable()`, torchtitan's per-block wrappers).
oneiter's rule: **the recorded forward of a checkpointed call is its first execution**. A recomputation adds no
call, no tensor and no probe; its random ops take the values its first execution got (`randomness.py`); nothing
oneiter runs inside a checkpointed region saves a tensor for autograd (`untracked()`), so the recomputation saves
the same tensors as the forward — torch's `CheckpointError` is its check that it does.

What the two kinds of checkpoint need for the *backward* entries:
- **non-reentrant** (`use_reentrant=False`, Hugging Face's default): backward runs the forward's own graph, only
  its saved tensors are recomputed. The gradient hooks the capture put on the forward's outputs and nodes fire as
  without checkpointing: the recomputation needs nothing.
- **reentrant** (`use_reentrant=True`): the forward of the region ran under `no_grad` (no graph, no gradient
  hooks); backward reruns it with gradients on and differentiates that graph. Each recomputed call is mapped onto
  its first execution (`Recomputations.begin`) and gets the gradient hooks there, named after that call. The
  mapping: the recomputation runs while autograd executes the region's `CheckpointFunctionBackward` node, created
  right before the region's forward ran, so the region's first call is the first call begun after that node (a
  forward call; for a reentrant region inside another one, whose node the outer recomputation created, the
  recomputed call that repeats it); later calls follow the forward's call tree (each call's children in order,
  then its next sibling), and a
  module that is not the expected one stops the mapping for the rest of that region (its calls then have no
  backward entries, on both sides alike). Calls inside a reentrant forward also have their arguments' structure
  recorded as if gradients were on (`in_reentrant_forward`): their probes then differentiate as the
  recomputation does.
"""

from __future__ import annotations

import bisect
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["Recomputations", "in_backward", "in_reentrant_forward", "untracked", "checkpoint_disabled"]


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a module called now is being recomputed)."""
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _reentrant_forward_code():
    from torch.utils import checkpoint

    function = getattr(checkpoint, "CheckpointFunction", None)
    return function.forward.__code__ if function is not None else None


def in_reentrant_forward() -> bool:
    """Whether this runs inside the forward of a reentrant checkpoint (torch's `CheckpointFunction`), which runs
    its region under `no_grad`: a frame of it is on the stack. Only asked where gradients are off."""
    code = _reentrant_forward_code()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _same(value):
    return value


@contextmanager
def untracked() -> Iterator[None]:
    """oneiter's own work inside a forward (a probe's rerun): the tensors it saves for autograd stay out of any
    saved-tensor hooks in force, so a checkpointed region's forward saves only the model's tensors (what its
    recomputation saves again). A no-op where no such hooks are in force."""
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None or top(False) is None:
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        yield


def _call_directly(function, _preserve_rng_state, *args):
    return function(*args)


def _no_frame(*_args, **_kwargs):
    yield


@contextmanager
def checkpoint_disabled() -> Iterator[None]:
    """`torch.utils.checkpoint.checkpoint` runs its function straight (reentrant or not) for the block: a probe's
    rerun of a call whose own code checkpoints a region computes the same values and gradients, without a
    recomputation in its backward (whose module calls would meet the rerun's forced children a second time)."""
    from torch.utils import checkpoint

    function = getattr(checkpoint, "CheckpointFunction", None)
    generator = getattr(checkpoint, "_checkpoint_without_reentrant_generator", None)
    had_apply = function is not None and "apply" in function.__dict__
    saved_apply = function.__dict__.get("apply") if had_apply else None
    if function is not None:
        function.apply = _call_directly
    if generator is not None:
        checkpoint._checkpoint_without_reentrant_generator = _no_frame
    try:
        yield
    finally:
        if function is not None:
            if had_apply:
                function.apply = saved_apply
            else:
                del function.apply
        if generator is not None:
            checkpoint._checkpoint_without_reentrant_generator = generator


class _Call:
    """One forward call, as the mapping needs it."""

    __slots__ = ("key", "module", "first", "grad", "children", "parent")

    def __init__(self, key: str, module: int, first: int, grad: bool, parent: "_Call | None"):
        self.key, self.module, self.first, self.grad, self.parent = key, module, first, grad, parent
        self.children: list[_Call] = []


class _Frame:
    """An open recomputed call: the forward call it repeats (None: not mapped) and the next child expected."""

    __slots__ = ("call", "cursor", "pending")

    def __init__(self, call: "_Call | None", cursor: int = 0):
        self.call, self.cursor = call, cursor
        self.pending: tuple[Any, int] | None = None  # (the input gradients' hooks under way, the first node)


class Recomputations:
    """The forward's call tree, and the mapping of recomputed calls onto it (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []  # forward calls in execution order
        self._firsts: list[int] = []  # their `first` node numbers (never decreasing): bisected per recomputation
        self._root = _Call("", 0, -1, True, None)  # the calls made outside every recorded call
        self._open: list[_Call] = []
        self._episode: tuple[int, int] | None = None
        self._stack: list[_Frame] = []
        self._region: _Frame | None = None  # where the running recomputation's region starts in the call tree
        self._again: list[_Call] = []  # the forward calls mapped recomputed calls repeat, in the order they ran
        self._again_firsts: list[int] = []  # the node number each of those recomputed calls began at
        self.num_calls = 0  # recomputed module calls
        self.num_mapped = 0  # of those, mapped onto their first execution (reentrant checkpoints)

    # -- the forward --------------------------------------------------------------------------------------------------
    def forward_begin(self, key: str, module, first: int) -> None:
        import torch

        parent = self._open[-1] if self._open else self._root
        call = _Call(key, id(module), first, torch.is_grad_enabled(), parent)
        parent.children.append(call)
        self.calls.append(call)
        self._firsts.append(first)
        self._open.append(call)

    def forward_end(self) -> None:
        if self._open:
            self._open.pop()

    # -- the recomputation --------------------------------------------------------------------------------------------
    def begin(self, module, first: int) -> _Frame:
        """A recomputed call begins (`first`: the number the next autograd node gets); its frame names the forward
        call it repeats where that needs gradient hooks (a reentrant checkpoint's region), else None."""
        self.num_calls += 1
        self._new_episode()
        if not self._stack:
            frame = self._stack_top(module)
        else:
            frame = self._child(self._stack[-1], module)
        if frame.call is not None:
            self.num_mapped += 1
            self._again.append(frame.call)
            self._again_firsts.append(first)
        self._stack.append(frame)
        return frame

    def end(self) -> _Frame | None:
        return self._stack.pop() if self._stack else None

    def recomputing(self) -> bool:
        """Whether a recomputed call is open (activation checkpointing runs a region again)."""
        return bool(self._stack)

    def _new_episode(self) -> None:
        """A recomputation runs while autograd executes one node; another node (or another backward) is another
        recomputation. A non-reentrant one stops early with an exception: its open frames are dropped here."""
        import torch

        node = torch._C._current_autograd_node()
        episode = (torch._C._current_graph_task_id(), node._sequence_nr() if node is not None else -1)
        if episode != self._episode:
            self._episode = episode
            self._stack.clear()
            self._region = self._region_start(node)

    def _region_start(self, node) -> _Frame | None:
        """The forward call tree position a reentrant region starts at: the first call begun after its
        `CheckpointFunctionBackward` node was created (None: not a reentrant region)."""
        import torch

        if node is None or not isinstance(node, torch.autograd.function.BackwardCFunction):
            return None
        created = node._sequence_nr()
        found = []  # the first call begun after the node: in the forward, or (an inner region) recomputed
        for firsts, calls in ((self._firsts, self.calls), (self._again_firsts, self._again)):
            index = bisect.bisect_right(firsts, created)
            if index < len(calls):
                found.append((firsts[index], calls[index]))
        first = min(found, key=lambda f: f[0])[1] if found else None
        if first is None or first.grad:
            return None
        parent = first.parent
        assert parent is not None  # a recorded call hangs under the root or an open call
        return _Frame(parent, parent.children.index(first))

    def _stack_top(self, module) -> _Frame:
        region = self._region
        if region is None:
            return _Frame(None)
        return self._child(region, module)

    def _child(self, parent: _Frame, module) -> _Frame:
        """The frame of the next call inside `parent`: its next expected child, if it is a call of `module`."""
        if parent.call is None or parent.cursor >= len(parent.call.children):
            return _Frame(None)
        call = parent.call.children[parent.cursor]
        if call.module != id(module):
            parent.call = None  # the recomputation left the forward's path: map nothing more of it
            return _Frame(None)
        parent.cursor += 1
        return _Frame(call if not call.grad else None)
