"""Where in the user's model an exception of the recorded iteration was raised: the module call, forward or
backward, and the user's own line. `Recorder.locate` asks here; `oneiter record` turns the answer into one
`UserCodeError` line (exit 2) through `errors.user_code`.

- forward: the capture's stack of open calls (each pre-hook pushed one, the post-hooks never ran). The call named
  is the one whose module's code holds the user's innermost frame (`layers.1.mlp@0`, which fed its Linear the
  wrong width), with the innermost open call beside it when that differs (`layers.1.mlp.down@0`, which raised).
- backward: autograd's engine raises from C++, under no frame of the user's (so `errors.user_frame` finds none).
  For a tensor saved for backward and then changed in place, the failing node is found by walking the graph from
  the tensor backward ran on and reading each node's saved tensors (the changed one raises the engine's message
  again). Its sequence number, given when forward created it, lies in the range the capture noted for the call
  that created it (`ModuleCapture.call_of_node`). The user's line: the model's forward runs once more under
  anomaly detection (which keeps each node's creation stack), and the node at the same position among the nodes
  the model created (the hooks' own left out, `ModuleCapture.model_node_index`) gives it, when its kind matches;
  otherwise the message says the line was not found. A custom `autograd.Function` whose backward raises is found
  by its `ctx` (the node itself) in the user's frame.
"""

from __future__ import annotations

import re
import warnings
from contextlib import ExitStack
from typing import Any

from oneiter.errors import innermost_user
from oneiter.record.capture.hooks import next_node_number
from oneiter.record.capture.structure import flatten

__all__ = ["forward_place", "backward_place", "changed_saved_node", "creation_frame"]

INPLACE = "modified by an inplace operation"
_STACK_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _at(frame: tuple[str, int, str]) -> str:
    return f"at {frame[0]}:{frame[1]}, in {frame[2]}"


def _frames(tb) -> list:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def forward_place(capture, tb, frame: tuple[str, int, str] | None) -> tuple[str, str] | None:
    """(what, where) for an exception raised with module calls open, or None (no call open, or no user frame)."""
    open_calls = capture.open_calls()
    if not open_calls or frame is None:
        return None
    innermost = open_calls[-1][0]
    path = _module_of_frame(capture, _frames(tb), frame)
    key = next((k for k, p in reversed(open_calls) if p == path), innermost)
    where = _at(frame) + (f", calling {innermost}" if innermost != key else "")
    return f"the forward of {key}", where


def _module_of_frame(capture, frames: list, frame: tuple[str, int, str]) -> str | None:
    """The recorded module whose forward runs the user's frame: the innermost `self` that is one, at or outside it."""
    index = max((i for i, (f, line) in enumerate(frames)
                 if (f.f_code.co_filename, line, f.f_code.co_name) == frame), default=-1)
    for f, _line in reversed(frames[:index + 1]):
        path = capture.path_of(f.f_locals.get("self"))
        if path is not None:
            return path
    return None


def backward_place(capture, node, frame: tuple[str, int, str] | None, note: str = "") -> tuple[str, str]:
    """(what, where) for backward's failure at autograd node `node` (created by the user's `frame`, if known)."""
    key = capture.call_of_node(node._sequence_nr())
    what = f"the backward of {key}" if key else "backward (of a node created outside every recorded call)"
    if frame is not None:
        return what, f"its node {node.name()} was created {_at(frame)}"
    return what, f"its node {node.name()} was created in {'the forward of ' + key if key else 'the loss'}; {note}"


def function_node(tb):
    """The node of a custom `autograd.Function` whose backward (the user's code) raised: its `ctx`, or None."""
    import torch

    for f, _line in reversed(_frames(tb)):
        ctx = f.f_locals.get("ctx")
        if isinstance(ctx, torch.autograd.function.BackwardCFunction):
            return ctx
    return None


def changed_saved_node(root, exc: BaseException):
    """The node behind `root` whose saved tensor was changed in place since forward saved it (reading it raises
    the engine's message `exc` again), or None."""
    message = str(exc)
    if INPLACE not in message or getattr(root, "grad_fn", None) is None:
        return None
    seen: set = set()
    todo = [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(nxt for nxt, _ in node.next_functions)
        if _saved_raises(node, message):
            return node
    return None


def _saved_raises(node, message: str) -> bool:
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            getattr(node, name)
        except RuntimeError as err:
            if str(err) == message:
                return True
    return False


def creation_frame(model, call: tuple, capture, node, autocast=None) -> tuple[tuple[str, int, str] | None, str]:
    """The user's frame that created `node` in the first forward `call` (args, kwargs, first node number), found
    by running that forward again under anomaly detection; (None, why) when it cannot be found. The rerun has no
    hooks and no random-op modes; the model's state (batch-norm statistics) moves: the recording is failing."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    args, kwargs, first = call
    index = capture.model_node_index(node._sequence_nr(), first)
    try:
        with ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")  # anomaly detection's own warning
            stack.enter_context(_disable_current_modes())
            stack.enter_context(capture.suspended())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.detect_anomaly(check_nan=False))
            if autocast is not None:
                stack.enter_context(autocast)
            begin = next_node_number()
            out = model(*args, **kwargs)
        twin = _numbered(out, begin + index)
    except Exception as exc:  # noqa: BLE001 - the user's forward may fail differently the second time
        return None, f"the line was not found (rerunning the forward to find it raised {type(exc).__name__})"
    if twin is None or twin.name() != node.name():
        return None, "the line was not found (a rerun of the forward under anomaly detection did not match it)"
    stack_lines = twin.metadata.get("traceback_") or []
    frames = [(m["file"], int(m["line"]), m["func"]) for text in stack_lines for m in [_STACK_LINE.search(text)] if m]
    found = innermost_user(frames)
    return found, "" if found is not None else "the line was not found (no frame of the user's created it)"


def _numbered(out: Any, number: int):
    """The node numbered `number` in the graph behind the tensors of `out`, or None."""
    import torch

    seen: set = set()
    todo = [v.grad_fn for _, v in flatten(out, "output") if isinstance(v, torch.Tensor)]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node._sequence_nr() == number:
            return node
        todo.extend(nxt for nxt, _ in node.next_functions)
    return None
