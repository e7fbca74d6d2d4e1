"""OpTracer: each aten op rerun alone on the inputs it was given (taken before an in-place op writes), in float64 on
the CPU, or through its decomposition, or in float32, or in its own dtype; random ops, views and uninitialized
outputs are listed, never judged."""

from __future__ import annotations

import pytest
import torch
from torch._decomp import decomposition_table

from oneiter.record.replay.op_rerun import RANDOM_NOTE, OpTracer


def trace(fn, *args):
    tracer = OpTracer()
    with tracer.watching("forward"):
        fn(*args)
    return {row.op: row for row in tracer.rows}


def test_an_inplace_op_is_rerun_on_its_input_before_it_wrote():
    rows = trace(lambda x: x.clone().mul_(2.0).add_(1.0), torch.randn(4, 5))
    # taken after the op, the rerun would double the doubled values: rel_l2 1.0
    assert rows["aten::mul_.Tensor"].rel_l2 == 0.0 and rows["aten::mul_.Tensor"].reference == "cpu float64"
    assert rows["aten::add_.Tensor"].rel_l2 < 1e-7
    assert rows["aten::add_.Tensor"].line.startswith("tests/record/replay/test_op_tracer.py:")


def test_random_ops_views_and_uninitialized_outputs_are_not_judged():
    rows = trace(lambda x: (torch.nn.functional.dropout(x, 0.5, training=True), x.t(), torch.empty(3)),
                 torch.randn(4, 5))
    assert rows["aten::bernoulli_.float"].note == RANDOM_NOTE and not rows["aten::bernoulli_.float"].judged
    assert rows["aten::t"].note == "view" and not rows["aten::t"].computes
    assert rows["aten::empty.memory_format"].note == "uninitialized values"
    assert rows["aten::mul.Tensor"].judged  # the mask applied: judged like any op


@pytest.fixture
def fused():
    """A fused op whose CPU kernel has no float64 (like `_grouped_mm`), registered for the test only."""
    lib = torch.library.Library("oneiter_test", "DEF")
    lib.define("fused_scale(Tensor x) -> Tensor")

    def kernel(x):
        if x.dtype == torch.float64:
            raise RuntimeError("fused_scale: expected Float, BFloat16 or Half, got Double")
        return x * 3

    lib.impl("fused_scale", kernel, "CPU")
    yield torch.ops.oneiter_test.fused_scale.default
    decomposition_table.pop(torch.ops.oneiter_test.fused_scale.default, None)
    lib._destroy()


def test_an_op_without_float64_is_judged_through_its_decomposition_else_a_lower_precision(fused):
    x = torch.randn(8, 8)
    decomposition_table[fused] = lambda t: t * 3
    row = trace(fused, x)["oneiter_test::fused_scale"]
    # its CPU kernel is no kernel of torch's: the trusted rerun in float64 runs torch's decomposition instead
    assert row.reference == "cpu float64" and row.rel_l2 < 1e-7
    assert row.note == ("its CPU kernel is not torch's own: rerun through torch's decomposition (torch._decomp) into "
                        "other ops")
    del decomposition_table[fused]
    assert trace(fused, x.bfloat16())["oneiter_test::fused_scale"].reference == "cpu float32"
    row = trace(fused, x)["oneiter_test::fused_scale"]
    assert row.reference == "cpu, the op's own dtypes" and row.rel_l2 == 0.0
    assert row.note.startswith("its CPU kernel is not torch's own: rerun through its own kernel in float64")
