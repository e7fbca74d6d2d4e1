"""The gradient of one module call w.r.t. each of its inputs, read off the autograd graph without changing it.

Where this sits: `ModuleCapture` calls `start()` in a module's forward pre-hook and `finish()` in its forward
hook. A tensor hook on an input would see the sum over *every* consumer of that tensor (a block's input feeds
both conv1 and the residual), and handing the module an alias (`x.view_as(x)`) instead changes the order in
which autograd adds the consumers' gradients, so recording would change gradient bits (it did for llama_tiny).
Instead:

1. at the pre-hook, remember each input's gradient edge (the autograd node and output slot that produced it)
   and a watermark: the sequence number of a node created right then;
2. at the forward hook, walk back from the outputs through the nodes created since the watermark (the module's
   own nodes) and collect every edge that leads into an input: those nodes are the module's consumers of it;
3. a post-hook on each consumer node reads the gradient it sends to the input; their sum, once all have fired,
   is the module's grad_input.

The graph, the engine's schedule and its accumulation order are untouched. An in-place module (ReLU(inplace))
needs no special case: its node consumes the input's old edge — unless the input is a *view* (nn.Linear with a
bias returns a view of its 2-d matmul for a 3-d input): an in-place op on a view makes a `CopySlices` node that
consumes the edge of the view's *base* instead. So the base's edge is a target too, for such an input: what a
consumer sends it is the gradient w.r.t. the whole base, and the input's part is its region of it (`view_region`).
Limits: nodes created on another thread during the forward are not seen; a consumer that never runs (an unused
branch) leaves that grad_input unrecorded.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

__all__ = ["InputGradTracker", "view_region", "region_of"]


def view_region(tensor) -> tuple | None:
    """(shape, strides, offset into its base) of a view whose base is produced by an autograd node and contiguous:
    how to take the view's part out of a gradient w.r.t. its base (`region_of`); None for any other tensor."""
    base = getattr(tensor, "_base", None)
    if base is None or base.grad_fn is None or not base.is_contiguous():
        return None
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset() - base.storage_offset()


def region_of(grad, region: tuple | None):
    """`grad` itself, or (a region) the part of a gradient w.r.t. a base that falls on the view."""
    if region is None:
        return grad
    return grad.contiguous().as_strided(*region)


class _Pending:
    """What `start` learned about one call: the inputs' edges and the watermark."""

    __slots__ = ("targets", "keep", "watermark", "views")

    def __init__(self, targets: dict, keep: list, watermark: int, views: list | None = None):
        self.targets = targets  # (id(node), output_nr) -> [(input name, its view's region of a base, or None)]
        self.keep = keep  # the target nodes, so their ids stay valid
        self.watermark = watermark
        self.views = views or []  # (input name, the view, its version as the call began): changed in place in the call?


class InputGradTracker:
    """Per-call input gradients via autograd node hooks (see the module docstring)."""

    def __init__(self) -> None:
        import torch

        self._anchor = torch.zeros((), requires_grad=True)
        self._handles: list = []

    def start(self, named_inputs: list[tuple[str, Any]]) -> _Pending | None:
        """Call in the forward pre-hook with (name, value) pairs; None when no input needs a gradient."""
        import torch
        from torch.autograd.graph import get_gradient_edge

        targets: dict[tuple[int, int], list[tuple[str, tuple | None]]] = defaultdict(list)
        keep, views = [], []
        for name, value in named_inputs:
            if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
                edge = get_gradient_edge(value)
                targets[(id(edge.node), edge.output_nr)].append((name, None))
                keep.append(edge.node)
                region = view_region(value)
                if region is not None and value._base is not None:  # if changed in place, the view hands its
                    base = get_gradient_edge(value._base)  # base's edge on (docstring); a region has a base
                    targets[(id(base.node), base.output_nr)].append((name, region))
                    keep.append(base.node)
                    views.append((name, value, value._version))
        if not targets:
            return None
        anchor = self._anchor.view(()).grad_fn
        assert anchor is not None  # a view of a leaf that requires grad
        watermark = anchor._sequence_nr()
        return _Pending(dict(targets), keep, watermark, views)

    def finish(self, pending: _Pending | None, outputs: list, on_grad: Callable[[str, Any], None]) -> None:
        """Call in the forward hook: find the consumers of each input and hook them."""
        if pending is None:
            return
        # a view the call did not change in place hands on its own edge: its base's edge is another tensor's
        # (DINOv2's pooler_output is a view of its last_hidden_state), no target of this input
        same = {name for name, view, version in pending.views if view._version == version}
        pending.views = []
        if same:
            pending.targets = {key: kept for key, names in pending.targets.items()
                               if (kept := [(n, r) for n, r in names if r is None or n not in same])}
        consumers = self._consumers(pending, outputs)
        for name, edges in consumers.items():
            self._hook(name, edges, on_grad)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _consumers(self, pending: _Pending, outputs: list) -> dict[str, list]:
        """name -> [(node, slot, region)]: the module's nodes whose edge `slot` leads into that input (or, `region`
        not None, into the base of that input, a view)."""
        import torch

        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        stack = [n for n in stack if _seq(n) > pending.watermark]
        found: dict[str, list] = defaultdict(list)
        # Python wrappers of autograd nodes are made on access and die with their last reference, and CPython
        # gives a new object the address (id) of one just freed: an id of a node no longer held could name the
        # next node visited, which the walk would then skip as seen. Holding every visited node keeps ids unique.
        seen: dict[int, Any] = {}
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for slot, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                names = pending.targets.get((id(nxt), nr))
                if names:
                    for name, region in names:
                        found[name].append((node, slot, region))
                elif _seq(nxt) > pending.watermark and id(nxt) not in seen:
                    stack.append(nxt)
        return found

    def _hook(self, name: str, edges: list, on_grad: Callable[[str, Any], None]) -> None:
        state: dict[str, Any] = {"sum": None, "left": len(edges)}

        def make(slot: int, region: tuple | None):
            def hook(grad_inputs, _grad_outputs):
                grad = grad_inputs[slot]
                if grad is not None:
                    grad = region_of(grad, region)
                    state["sum"] = grad if state["sum"] is None else state["sum"] + grad
                state["left"] -= 1
                if state["left"] == 0 and state["sum"] is not None:
                    on_grad(name, state["sum"])

            return hook

        for node, slot, region in edges:
            self._handles.append(node.register_hook(make(slot, region)))


def _seq(node) -> int:
    """A node's sequence number; AccumulateGrad (a leaf's node) has the largest one, so it is excluded."""
    if type(node).__name__ == "AccumulateGrad":
        return -1
    return node._sequence_nr()

