"""Per-module forward and backward ranges in the profiler's events, named by module path (`layer3.0.conv1`).

Where it sits: the runner installs `ModuleRanges` on the model around the profiled steps; `tables.module_table`
reads the ranges back from the profiler's events and `trace.write_trace` draws the backward ones on their own track.
torch.profiler's own module names (`nn.Module: Conv2d_0`) say neither where a module sits nor which backward work
is its; these ranges do.

Forward: a forward pre-hook opens the range `oneiter.fwd::<path>` (the root module is `(root)`, as in
recordings), a forward hook (registered `always_call`, so an exception closes it too) closes it. Every call of a
module gets its own range; the table sums them.

Backward: in the forward hook, the autograd nodes created during this call (sequence number between the pre-hook
and the hook, reachable from the outputs) each get a node pre-hook and post-hook. The first node of the call to
run emits the marker `oneiter.bwd.begin::<path>@<call>` (call N of that module in the step, as recordings name
it), the last one to finish emits `oneiter.bwd.end::...`.
Markers, not a range: autograd hooks run *inside* the engine's `autograd::engine::evaluate_function` events, so a
range opened in one node and closed in another would straddle those events, break the nesting of the trace and
steal their child ops (inflating their self time). `trace.py` turns each marker pair into a span.

Limits:
- Hooks only observe: no tensor is kept, no gradient is touched, numerics are unchanged. Module-level backward
  hooks are not used: `register_full_backward_hook` raises on ResNet's `ReLU(inplace=True)`.
- Writing parameter gradients (`AccumulateGrad`) happens right after a module's last node, outside its range.
- A node that never runs (an output that does not reach the loss) would leave its call open: such calls end at the
  end of the backward pass and are counted in `num_unfinished`.
- A module object registered under two paths is reported under the first one (`named_modules()` order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from oneiter.format.schema import ROOT_MODULE, call_key

__all__ = [
    "FWD", "BWD", "BWD_BEGIN", "BWD_END", "ROOT", "ModuleRanges", "display_path", "module_path", "split_marker",
]

FWD = "oneiter.fwd::"
BWD = "oneiter.bwd::"  # the span `trace.py` draws from a begin/end marker pair
BWD_BEGIN = "oneiter.bwd.begin::"
BWD_END = "oneiter.bwd.end::"


def split_marker(name: str) -> tuple[str, str] | None:
    """A backward marker's ("begin" | "end", label `path#call`), or None for any other event name."""
    if name.startswith(BWD_BEGIN):
        return "begin", name[len(BWD_BEGIN):]
    if name.startswith(BWD_END):
        return "end", name[len(BWD_END):]
    return None
ROOT = ROOT_MODULE  # how tables show the root module (path "" in `named_modules()`): the recordings' name


def display_path(path: str) -> str:
    """A module path as range names and tables show it: the root module ("") as `(root)`."""
    return path or ROOT


def module_path(display: str) -> str:
    """Inverse of `display_path`: the `named_modules()` path."""
    return "" if display == ROOT else display


def _range_class():
    try:  # no dispatcher op per enter/exit, so no extra rows in the op table (torch >= 2.2)
        from torch._C._profiler import _RecordFunctionFast

        return _RecordFunctionFast
    except ImportError:
        from torch.autograd.profiler import record_function

        return record_function


def _sequence_counter():
    """The next autograd sequence number of this thread, or None when torch does not expose it."""
    try:
        from torch._C._autograd import _get_sequence_nr
    except ImportError:
        return None
    return _get_sequence_nr


def _tensors(value: Any, depth: int = 0) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item, depth + 1)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item, depth + 1)]
    return []


def _nodes_created_between(roots: list, low: int, high: int) -> list:
    """Autograd nodes reachable from `roots` whose sequence number lies in [low, high): those this call created.
    AccumulateGrad nodes (sequence number UINT64_MAX) and everything made before the call fall outside."""
    found: dict[int, Any] = {}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is None or id(node) in found:
            continue
        if not low <= node._sequence_nr() < high:
            continue
        found[id(node)] = node
        todo.extend(fn for fn, _ in node.next_functions)
    return list(found.values())


@dataclass
class _BackwardCall:
    label: str  # "<display path>#<call number>", unique within the run
    remaining: int  # nodes of this call that have not finished yet
    begun: bool = False
    ended: bool = False


class _NodeHooks:
    """The one pre-hook and one post-hook oneiter puts on a node, serving every module call that owns the node.
    Calls are kept innermost first: begins run outermost first and ends innermost first, so spans nest."""

    __slots__ = ("owner", "calls")

    def __init__(self, owner: "ModuleRanges"):
        self.owner = owner
        self.calls: list[_BackwardCall] = []

    def pre(self, grad_outputs):
        for call in reversed(self.calls):
            self.owner._begin(call)

    def post(self, grad_inputs, grad_outputs):
        for call in self.calls:
            call.remaining -= 1
            if call.remaining == 0:
                self.owner._end(call)


class ModuleRanges:
    """Context manager: while active, every module call of `model` leaves forward and backward ranges.

    `module_types` maps each module path to its class name. Usage::

        with ModuleRanges(model) as ranges:
            train_step(...)
    """

    def __init__(self, model, *, backward: bool = True):
        self.model = model
        self.module_types: dict[str, str] = {}
        self.num_unfinished = 0
        self._next_seq = _sequence_counter()
        self.backward = backward and self._next_seq is not None
        self._range = _range_class()
        self._handles: list = []
        self._stack: list[tuple[str, Any, int, int]] = []  # open forward calls: (path, range, first seq, call index)
        self._nodes: dict[int, tuple[Any, _NodeHooks]] = {}  # this forward's hooked nodes, kept alive until it ends
        self._node_handles: list = []
        self._open: dict[str, _BackwardCall] = {}
        self._callback_queued = False
        self._calls_of: dict[str, int] = {}  # path -> forward calls so far in this step: `path@N` is call N

    def __enter__(self) -> "ModuleRanges":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def install(self) -> None:
        for path, module in self.model.named_modules():
            self.module_types[path] = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre, path)))
            self._handles.append(
                module.register_forward_hook(functools.partial(self._post, path), always_call=True)
            )

    def remove(self) -> None:
        """Remove every hook (module and node), close forward ranges left open by an exception."""
        for handle in self._handles + self._node_handles:
            handle.remove()
        self._handles.clear()
        self._node_handles.clear()
        while self._stack:
            self._stack.pop()[1].__exit__(None, None, None)
        self._nodes.clear()
        self._open.clear()

    # forward -------------------------------------------------------------------------------------------------
    def _pre(self, path: str, module, args) -> None:
        if not self._stack:  # a new outermost forward: the previous step's nodes and handles are gone
            self._node_handles.clear()
            self._calls_of.clear()
        call = self._calls_of.get(path, 0)
        self._calls_of[path] = call + 1
        first_seq = self._next_seq() if self.backward else 0
        rf = self._range(FWD + display_path(path))
        rf.__enter__()
        self._stack.append((path, rf, first_seq, call))

    def _post(self, path: str, module, args, output) -> None:
        index = len(self._stack) - 1
        while index >= 0 and self._stack[index][0] != path:  # only after an exception inside a child
            index -= 1
        if index < 0:
            return
        for _, rf, _, _ in reversed(self._stack[index:]):
            rf.__exit__(None, None, None)
        first_seq, call = self._stack[index][2], self._stack[index][3]
        del self._stack[index:]
        import torch

        if self.backward and output is not None and torch.is_grad_enabled():
            self._watch_backward(path, call, first_seq, output)
        if not self._stack:
            self._nodes.clear()

    # backward ------------------------------------------------------------------------------------------------
    def _watch_backward(self, path: str, call_index: int, first_seq: int, output) -> None:
        roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        nodes = _nodes_created_between(roots, first_seq, self._next_seq()) if roots else []
        if not nodes:
            return
        # `path@N`: call N of that module in this step, the name a recording gives the same call (`format.layout`)
        call = _BackwardCall(call_key(path, call_index), remaining=len(nodes))
        for node in nodes:
            entry = self._nodes.get(id(node))
            if entry is None:
                hooks = _NodeHooks(self)
                entry = self._nodes[id(node)] = (node, hooks)
                self._node_handles.append(node.register_prehook(hooks.pre))
                self._node_handles.append(node.register_hook(hooks.post))
            entry[1].calls.append(call)

    def _marker(self, name: str) -> None:
        with self._range(name):
            pass

    def _begin(self, call: _BackwardCall) -> None:
        if call.begun:
            return
        call.begun = True
        self._marker(BWD_BEGIN + call.label)
        self._open[call.label] = call
        if not self._callback_queued:
            import torch

            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end(self, call: _BackwardCall) -> None:
        if call.ended or not call.begun:
            return
        call.ended = True
        self._marker(BWD_END + call.label)
        self._open.pop(call.label, None)

    def _end_of_backward(self) -> None:
        # Calls still open own a node that never ran (its output did not reach the loss): end them here.
        for call in reversed(list(self._open.values())):
            self.num_unfinished += 1
            self._end(call)
        self._callback_queued = False
