"""Deliberately wrong torch.compile backends: a compiler pass that perturbs one op's result, as a vendor's graph
compiler with a bad rewrite would. Importing this module registers them (the way a vendor package registers its
backend); it does not know oneiter.

`wrong_<op>` (for each op of `OPS`): AOT autograd traces the graph Dynamo captured into an aten forward and
backward graph, as real backends receive them; the pass multiplies the result of every `aten.<op>` node of the
forward graph by `SCALE`, and both graphs then run op by op (what the `aot_eager` backend does). The gradient
flows through the perturbed value, so the backward is consistent with the wrong forward, as a real miscompiled
kernel's would be.
"""

import operator

import torch
from functorch.compile import make_boxed_func
from torch._dynamo import register_backend
from torch._dynamo.backends.common import aot_autograd

OPS = ("gelu", "silu", "relu", "convolution", "mm", "addmm", "mul")
SCALE = 1.0 + 1e-3


def _perturb(gm: torch.fx.GraphModule, op: str) -> None:
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.overloadpacket.__name__ != op:
            continue
        with gm.graph.inserting_after(node):
            wrong = gm.graph.call_function(operator.mul, (node, SCALE))
        node.replace_all_uses_with(wrong, delete_user_cb=lambda user, wrong=wrong: user is not wrong)
    gm.graph.lint()
    gm.recompile()


def _backend(op: str):
    def forward(gm, _example_inputs):
        _perturb(gm, op)
        return make_boxed_func(gm.forward)

    def backward(gm, _example_inputs):
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward, bw_compiler=backward)


for _op in OPS:
    register_backend(name=f"wrong_{_op}", compiler_fn=_backend(_op))
