"""OpFallback: `--fallback convolution` under bf16 autocast brings each conv's local error down to fp32 rounding."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oneiter.errors import OneIterError
from oneiter.record.modes.fallback import OpFallback, op_names, parse_fallback


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)).train()


def rel_l2(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def run(model, x, fallback: OpFallback | None):
    """Forward under bf16 autocast (with the fallback if given) and backward; returns each conv's (input, output)."""
    seen = []
    handles = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0].detach(), out)))
               for m in model if isinstance(m, nn.Conv2d)]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), fallback or contextlib.nullcontext():
            out = model(x)
        out.float().square().mean().backward()
    finally:
        for handle in handles:
            handle.remove()
    return seen, out


def local_errors(seen) -> list[float]:
    """Each conv's output vs the float32 computation of the same conv on the same input."""
    return [rel_l2(out, F.conv2d(inp.float(), m.weight, m.bias, m.stride, m.padding)) for m, inp, out in seen]


@pytest.fixture
def x():
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)


def test_without_fallback_convs_are_bf16(x):
    seen, out = run(conv_net(), x, None)
    assert [o.dtype for _, _, o in seen] == [torch.bfloat16, torch.bfloat16]
    assert all(1e-4 < e < 2e-2 for e in local_errors(seen))


def test_fallback_convolution_gives_fp32_local_error(x):
    model = conv_net()
    fallback = OpFallback(parse_fallback("convolution"))
    seen, out = run(model, x, fallback)
    assert [o.dtype for _, _, o in seen] == [torch.float32, torch.float32]
    assert local_errors(seen) == [0.0, 0.0]  # on the CPU the fallback is the fp32 conv itself: bitwise
    assert fallback.counts == {"conv2d": 2}
    assert x.grad is not None and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()


def test_backward_casts_gradients_to_input_dtype():
    """A bf16 model (--dtype bfloat16): the conv runs in fp32, autograd hands bf16 gradients back."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(torch.bfloat16)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    with OpFallback(["conv2d"]) as fallback:
        out = conv(x)
    assert out.dtype == torch.float32
    ref = F.conv2d(x.detach().float(), conv.weight.float(), conv.bias.float())
    assert torch.equal(out.detach(), ref)
    out.sum().backward()
    assert x.grad.dtype == conv.weight.grad.dtype == conv.bias.grad.dtype == torch.bfloat16
    assert fallback.counts == {"conv2d": 1}


def test_names_and_lowerings():
    assert "convolution" in op_names(F.conv2d) and "conv2d" in op_names(F.conv2d)
    assert {"linear", "addmm", "mm"} <= set(op_names(F.linear))
    assert {"matmul", "mm", "bmm"} <= set(op_names(torch.Tensor.__matmul__))
    assert "native_layer_norm" in op_names(F.layer_norm)


def test_only_matching_functions_move():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with OpFallback(["addmm"]) as fallback:
            y = lin(x)  # linear lowers to addmm: falls back, stays float32
            z = torch.relu(y) @ lin.weight.T  # matmul: untouched, autocast makes it bf16
            y.shape, y.view(-1), y.to(torch.float64)  # never fall back, even for a catch-all pattern
    assert y.dtype == torch.float32 and z.dtype == torch.bfloat16
    assert fallback.counts == {"linear": 1}
    with OpFallback([".*"]) as everything:
        (torch.randn(2, 2) @ torch.randn(2, 2)).relu_().view(-1)
    assert "view" not in everything.counts and everything.counts["matmul"] == 1
    assert everything.counts["relu_"] == 1


def test_inplace_copies_back():
    x = torch.randn(5, dtype=torch.bfloat16)
    expected = x.relu()
    with OpFallback(["relu.*"]) as fallback:
        result = x.relu_()
    assert result is x and torch.equal(x, expected) and fallback.counts == {"relu_": 1}


def test_out_argument_copies_back():
    a, b = torch.randn(3, 3, dtype=torch.bfloat16), torch.randn(3, 3, dtype=torch.bfloat16)
    out = torch.empty(3, 3, dtype=torch.bfloat16)
    with OpFallback(["mm"]) as fallback:
        result = torch.mm(a, b, out=out)
    assert result is out and torch.equal(out, (a.float() @ b.float()).bfloat16())
    assert fallback.counts == {"mm": 1}


def test_parse_fallback():
    assert parse_fallback("convolution,addmm") == ["convolution", "addmm"]
    assert parse_fallback(["conv.*", " mm ,"]) == ["conv.*", "mm"]
    assert parse_fallback(None) == [] and parse_fallback("") == []


@pytest.mark.parametrize("bad", ["conv(", "[mm", "*"])
def test_bad_regex(bad):
    with pytest.raises(OneIterError, match=re.escape(f"bad --fallback regex '{bad}'")):
        parse_fallback(f"convolution,{bad}")
    with pytest.raises(OneIterError, match="bad --fallback regex"):
        OpFallback([bad])
