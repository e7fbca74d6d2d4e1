"""`oneiter replay --layer PATH --ops` of a compiled block: what its compiled code shows, op by op.

Where this sits: a compiled block's kernels run inside the backend's compiled code (inductor's generated kernels,
a vendor's graph), where no dispatch mode sees them one by one. What can be seen is the graph Dynamo hands the
backend (`torch.fx`), node by node. `layer_replay.trace_layer` compiles the layer with `GraphTracer.backend()`, the
block's own backend behind an inspection: every computing node of each graph is also returned as an output of the
graph the backend compiles, so one forward of the compiled code hands over each node's value *as the compiled
code computed it*. Each node is then judged by its own error, as `op_rerun.OpTracer` judges an aten op: its target
rerun alone, on the CPU, in float64, on exactly the compiled values of its own inputs; its expected noise the same
rerun in the inputs' own dtypes against that, at least one unit roundoff. A backend pass that computes one node
wrong (a bad rewrite, a wrong fused kernel) is named by that node: its op, its user line.

What it cannot see: the backward graph (AOT autograd derives it inside the backend), and what happens between a
node's inputs and its value (a wrong fusion shows on the node whose value it changes). Exposing every node as an
output keeps the backend from fusing it away, so the values are the compiled code's, not its rounding's exact
replica. Nodes that draw random numbers are not judged (their rerun would draw new ones).
"""

from __future__ import annotations

import math
import operator
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from oneiter.record.local.rerun import tensor_stats
from oneiter.record.modes import trusted
from oneiter.record.replay.op_rerun import OpRow, _user_line_in
from oneiter.runtime.precision import unit_roundoff

__all__ = ["GraphTracer", "GRAPH_NOTE"]

GRAPH_NOTE = "a node of the compiled graph: its compiled value against its own op rerun in float64"
_COMPUTES = ("call_function", "call_method")
_RANDOM_WORDS = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial")
_PASSES = frozenset({operator.getitem})  # hands on a value another node computed


class GraphTracer:
    """Judges each node of a compiled block's graphs (module docstring); the `OpTracer` interface `trace_layer`
    drives (`watching`, `rows`, `case`), with `backend()` to compile the layer with."""

    def __init__(self, backend: str):
        self.backend_name = backend
        self.rows: list[OpRow] = []
        self.case = None  # a graph node has no aten op to write a reproducer for
        self._runs: list[tuple[torch.fx.GraphModule, list, dict]] = []  # (graph, its runtime inputs, node values)
        self._graphs = 0
        self._active = False

    def backend(self):
        """A torch.compile backend: the block's own, compiling each graph with every computing node exposed."""
        from torch._dynamo.backends.registry import lookup_backend

        inner = lookup_backend(self.backend_name)

        def inspect(gm: torch.fx.GraphModule, example_inputs):
            self._graphs += 1
            exposed, nodes = _exposed(gm)
            compiled = inner(exposed, example_inputs)
            count = len(nodes)

            def run(*args):
                given = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
                out = compiled(*args)
                if self._active:
                    values = dict(zip(nodes, out[len(out) - count:], strict=True))
                    self._runs.append((gm, given, values))
                return tuple(out[:len(out) - count])

            return run

        return inspect

    @contextmanager
    def watching(self, phase: str) -> Iterator[None]:
        """The forward's graphs are watched; the backward's are not observable node by node."""
        self._active = phase == "forward"
        try:
            yield
        finally:
            if self._active:
                self._judge()
            self._active = False

    def _judge(self) -> None:
        for gm, given, values in self._runs:
            env: dict[str, Any] = {}
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            env.update({n.name: v for n, v in zip(placeholders, given, strict=False)})
            env.update({n.name: v for n, v in values.items()})
            for node in gm.graph.nodes:
                if node in values:
                    self.rows.append(self._row(node, env))
        self._runs.clear()

    def _row(self, node, env: dict) -> OpRow:
        produced = env[node.name]
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env.get(n.name))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        row = OpRow(len(self.rows), _name(node), "forward", [list(t.shape) for t in tensors],
                    [str(t.dtype).removeprefix("torch.") for t in tensors], [list(t.stride()) for t in tensors],
                    [int(t.storage_offset()) for t in tensors],
                    line=_user_line_in((node.meta.get("stack_trace") or "").splitlines()), note=GRAPH_NOTE)
        if node.target in _PASSES:
            row.computes, row.note = False, "an item of another node's result"
            return row
        if any(word in row.op for word in _RANDOM_WORDS):
            row.note = "random: a compiled graph draws its own numbers, its rerun others; not judged"
            return row
        if not isinstance(produced, torch.Tensor) or not produced.is_floating_point():
            row.computes, row.note = False, "no floating output"
            return row
        with torch.no_grad(), torch.autocast("cpu", enabled=False), trusted.running():
            exact = _call(node, args, kwargs, torch.float64)
            low = _call(node, args, kwargs, None)
        if not isinstance(exact, torch.Tensor) or tuple(exact.shape) != tuple(produced.shape):
            row.note = "not judged: its rerun on the CPU gives no tensor of its shape"
            return row
        stats = tensor_stats(exact, produced.detach().cpu())
        row.rel_l2, row.mismatch, row.reference = stats["rel_l2"], int(stats["mismatch"]), "cpu float64"
        row.roundoff = unit_roundoff(str(produced.dtype))
        noise = tensor_stats(exact, low)["rel_l2"] if isinstance(low, torch.Tensor) and \
            tuple(low.shape) == tuple(exact.shape) else None
        ok = noise is not None and math.isfinite(noise) and noise > row.roundoff
        row.noise, row.noise_from = (noise, "cpu") if ok else (row.roundoff, "unit roundoff")
        return row


def _exposed(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list]:
    """A copy of `gm` that also returns every computing node's tensor value, and those nodes, in graph order."""
    import copy

    graph = copy.deepcopy(gm.graph)
    nodes = [n for n in graph.nodes if n.op in _COMPUTES and isinstance(n.meta.get("example_value"), torch.Tensor)]
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    first = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    output.args = ((*first, *nodes),)
    graph.lint()
    exposed = torch.fx.GraphModule(gm, graph)
    originals = {n.name: n for n in gm.graph.nodes}
    return exposed, [originals[n.name] for n in nodes]


def _name(node) -> str:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)
    return f"fx::{name}"


def _call(node, args, kwargs, dtype):
    """The node's target on the CPU, floating tensors in `dtype` (None: their own), on fresh copies."""
    def cast(x):
        if isinstance(x, torch.Tensor):
            x = x.detach().to("cpu", copy=True)
            return x.to(dtype) if dtype is not None and x.is_floating_point() else x
        return x

    args, kwargs = torch.utils._pytree.tree_map(cast, (args, kwargs))
    try:
        if node.op == "call_method":
            out = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no CPU kernel in this dtype: not judged
        return None
    return out
