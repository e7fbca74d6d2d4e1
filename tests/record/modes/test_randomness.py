"""RandomRecorder / RandomReplayer: a run with another seed replays the reference's random values bit for bit."""

from __future__ import annotations

import copy

import h5py
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.writer import BackgroundWriter
from oneiter.record.capture.sink import TensorSink
from oneiter.record.modes.randomness import (
    RANDOM,
    RandomRecorder,
    RandomReplayer,
    dropout_with_mask,
    recorded_random_ops,
)


class Noisy(nn.Module):
    """Functional random ops inside forward: randn, rand_like, uniform_, randperm, dropout, rrelu."""

    def __init__(self, inplace_rrelu: bool = False):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.inplace_rrelu = inplace_rrelu

    def forward(self, x):
        h = self.lin1(x)
        h = h + 0.1 * torch.randn(h.shape) + 0.01 * torch.rand_like(h)
        h = h * h.new_empty(h.shape[-1]).uniform_(0.5, 1.5)
        h = h[:, torch.randperm(h.shape[-1])]
        h = F.rrelu(h.clone() if self.inplace_rrelu else h, training=True, inplace=self.inplace_rrelu)
        return self.lin2(F.dropout(h, 0.3, training=True))


class NativeDropout(nn.Module):
    """The fused dropout a CUDA/DIPU target runs for nn.Dropout, called directly so the CPU test can see it."""

    def __init__(self, p: float):
        super().__init__()
        self.lin1, self.lin2, self.p = nn.Linear(8, 16), nn.Linear(16, 4), p

    def forward(self, x):
        return self.lin2(torch.native_dropout(self.lin1(x), self.p, True)[0])


def dropout_mlp(extra: bool = False) -> nn.Module:
    torch.manual_seed(42)
    layers = [nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)]
    if extra:
        layers.insert(1, nn.Dropout(0.2))
    return nn.Sequential(*layers).train()


def step(model, x, requires_grad: bool, autocast: bool = False):
    """Forward + backward; returns (output, gradients) as detached copies."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + ([x.grad.clone()] if requires_grad else [])
    return out.detach().clone(), grads


def record(path, model, x, seed: int, requires_grad: bool = True, autocast: bool = False):
    writer = BackgroundWriter(path, {"model": "test"})
    sink = TensorSink(writer)
    torch.manual_seed(seed)
    with RandomRecorder(sink) as recorder:
        out, grads = step(model, x, requires_grad, autocast)
    writer.close({})
    return out, grads, recorder.num_ops


def replay(path, model, x, seed: int, requires_grad: bool = True, autocast: bool = False):
    with IterationFile(path) as ref:
        torch.manual_seed(seed)
        with RandomReplayer(ref, torch.device("cpu")) as replayer:
            out, grads = step(model, x, requires_grad, autocast)
        assert replayer.num_ops == len(replayer.ops)
    return out, grads


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and torch.equal(a, b)


def same(a_grads, b_grads) -> bool:
    return all(torch.equal(a, b) for a, b in zip(a_grads, b_grads, strict=True))


@pytest.fixture
def x():
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_dropout_replayed_bitwise(tmp_path, x, requires_grad):
    model = dropout_mlp()
    ref_out, ref_grads, num_ops = record(tmp_path / "ref.h5", copy.deepcopy(model), x, 0, requires_grad)
    assert num_ops == 1
    out, grads = replay(tmp_path / "ref.h5", copy.deepcopy(model), x, 123, requires_grad)
    assert_bitwise(out, ref_out)
    assert len(grads) == len(ref_grads) and same(grads, ref_grads)
    torch.manual_seed(123)
    plain_out, plain_grads = step(copy.deepcopy(model), x, requires_grad)
    assert not torch.equal(plain_out, ref_out) and not same(plain_grads, ref_grads)


def test_layout_and_reader(tmp_path, x):
    record(tmp_path / "ref.h5", dropout_mlp(), x, 0)
    with h5py.File(tmp_path / "ref.h5", "r") as f:
        assert f[RANDOM].attrs["num_ops"] == 1
        assert list(f[RANDOM].attrs["ops"]) == ["aten.bernoulli_.float"]
        dset = f[f"{RANDOM}/00000"]
        assert dset.attrs["op"] == "aten.bernoulli_.float" and dset.attrs["dtype"] == "bool"
        assert dset.shape == (6, 16)
    with IterationFile(tmp_path / "ref.h5") as ref:
        (op,) = recorded_random_ops(ref)
    assert (op.index, op.packet, op.paths, op.shapes) == (0, "bernoulli_", (f"{RANDOM}/00000",), ((6, 16),))


def test_recording_changes_nothing(tmp_path, x):
    model = Noisy()
    ref_out, ref_grads, _ = record(tmp_path / "ref.h5", copy.deepcopy(model), x, 0)
    torch.manual_seed(0)
    out, grads = step(copy.deepcopy(model), x, True)
    assert_bitwise(out, ref_out)
    assert same(grads, ref_grads)


def test_no_random_ops_still_writes_group(tmp_path, x):
    _, _, num_ops = record(tmp_path / "ref.h5", dropout_mlp().eval(), x, 0)
    assert num_ops == 0
    with IterationFile(tmp_path / "ref.h5") as ref:
        assert ref.has(RANDOM) and recorded_random_ops(ref) == []


@pytest.mark.parametrize("inplace_rrelu", [False, True])
def test_functional_random_ops(tmp_path, x, inplace_rrelu):
    model = Noisy(inplace_rrelu)
    ref_out, ref_grads, num_ops = record(tmp_path / "ref.h5", copy.deepcopy(model), x, 0)
    assert num_ops == 6  # randn, rand_like, uniform_, randperm, rrelu_with_noise, bernoulli_
    out, grads = replay(tmp_path / "ref.h5", copy.deepcopy(model), x, 123)
    assert_bitwise(out, ref_out)
    assert same(grads, ref_grads)


def test_replay_under_autocast(tmp_path, x):
    model = dropout_mlp()
    ref_out, ref_grads, _ = record(tmp_path / "ref.h5", copy.deepcopy(model), x, 0, autocast=True)
    assert ref_out.dtype == torch.bfloat16
    out, grads = replay(tmp_path / "ref.h5", copy.deepcopy(model), x, 123, autocast=True)
    assert_bitwise(out, ref_out)
    assert same(grads, ref_grads)


@pytest.mark.parametrize("p", [0.5, 0.3])
def test_native_dropout_replayed_bitwise(tmp_path, x, p):
    torch.manual_seed(42)
    model = NativeDropout(p)
    ref_out, ref_grads, _ = record(tmp_path / "ref.h5", copy.deepcopy(model), x, 0)
    with IterationFile(tmp_path / "ref.h5") as ref:
        (op,) = recorded_random_ops(ref)
        assert op.op == "aten.native_dropout.default" and op.paths[1].endswith("00000.1")
        assert ref.dtype_of(op.paths[1]) == "bool"
    out, grads = replay(tmp_path / "ref.h5", copy.deepcopy(model), x, 123)
    assert_bitwise(out, ref_out)
    assert same(grads, ref_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.5, 0.1, 0.123, 0.9])
def test_dropout_with_mask_matches_cpu_kernel(dtype, p):
    x = torch.randn(300, 17).to(dtype)
    out, mask = torch.native_dropout(x, p, True)
    assert_bitwise(dropout_with_mask(x, mask, p), out)


def test_cpu_dropout_replays_into_native_dropout(tmp_path, x):
    """A CPU reference records bernoulli_; a device target's nn.Dropout is native_dropout: same mask."""
    ref_model = dropout_mlp()
    ref_out, ref_grads, _ = record(tmp_path / "ref.h5", copy.deepcopy(ref_model), x, 0)
    target = NativeDropout(0.5)
    target.lin1.load_state_dict(ref_model[0].state_dict())
    target.lin2.load_state_dict(ref_model[2].state_dict())
    out, grads = replay(tmp_path / "ref.h5", target, x, 123)
    assert_bitwise(out, ref_out)  # p=0.5: x*(1/0.5) and x*(mask*2) round alike
    assert same(grads, ref_grads)


def test_extra_random_op_raises(tmp_path, x):
    record(tmp_path / "ref.h5", dropout_mlp(), x, 0)
    with pytest.raises(OneIterError, match=r"random op #1: the reference recorded only 1 random ops, got "
                                           r"aten\.bernoulli_\.float shape \[6, 16\]"):
        replay(tmp_path / "ref.h5", dropout_mlp(extra=True), x, 123)


def test_different_shape_raises(tmp_path, x):
    record(tmp_path / "ref.h5", dropout_mlp(), x, 0)
    with pytest.raises(OneIterError, match=r"random op #0: expected aten\.bernoulli_\.float shape \[6, 16\] from "
                                           r"the reference, got aten\.bernoulli_\.float shape \[4, 16\]"):
        replay(tmp_path / "ref.h5", dropout_mlp(), x[:4], 123)


def test_missing_random_op_raises(tmp_path, x):
    record(tmp_path / "ref.h5", dropout_mlp(), x, 0)
    with pytest.raises(OneIterError, match=r"random op #0: expected aten\.bernoulli_\.float shape \[6, 16\] from "
                                           r"the reference, got none"):
        replay(tmp_path / "ref.h5", dropout_mlp().eval(), x, 123)


class RngOperators(nn.Module):
    """Dropout as compiled activation checkpointing runs it: inside `run_and_save_rng_state`, then drawn again by
    `run_with_rng_state` from the state it saved (outside autograd, as inside a compiled graph)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

        h = self.lin(x).detach()
        state, (first, _mask) = run_and_save_rng_state(torch.ops.aten.native_dropout.default, h, 0.5, True)
        again, _mask = run_with_rng_state(state, torch.ops.aten.native_dropout.default, h, 0.5, True)
        return first, again


def test_random_ops_inside_higher_order_operators_are_recorded_and_replayed(tmp_path, x):
    """The random modes run a higher-order operator with themselves active inside it: both dropouts are recorded,
    and a replay under another seed gives each the reference's mask (without that, torch refuses the operator)."""
    model = RngOperators()
    writer = BackgroundWriter(tmp_path / "ref.h5", {"model": "test"})
    torch.manual_seed(0)
    with RandomRecorder(TensorSink(writer)) as recorder:
        ref_first, ref_again = model(x)
    writer.close({})
    assert recorder.num_ops == 2 and torch.equal(ref_first, ref_again)  # the same state: the same mask
    with IterationFile(tmp_path / "ref.h5") as ref:
        torch.manual_seed(123)
        with RandomReplayer(ref, torch.device("cpu")) as replayer:
            first, again = model(x)
        assert replayer.num_ops == 2
    assert_bitwise(first, ref_first) and assert_bitwise(again, ref_again)
    torch.manual_seed(123)
    assert not torch.equal(model(x)[0], ref_first)


def test_a_compilers_own_random_op_is_not_the_iterations(tmp_path):
    """An op dispatched while a compiler traces (a fake or proxy mode active: inductor's pattern matcher traces
    `torch.randperm` when DDP's graph splitter compiles lazily, inside the iteration) passes through unrecorded."""
    from torch.fx.experimental.proxy_tensor import make_fx

    writer = BackgroundWriter(tmp_path / "ref.h5", {"model": "test"})
    with RandomRecorder(TensorSink(writer)) as recorder:
        make_fx(lambda t: t[torch.randperm(t.shape[0])], tracing_mode="fake")(torch.ones(4))
    writer.close({})
    assert recorder.num_ops == 0


def test_an_operator_oneiters_mode_cannot_run_is_oneiters_error_not_the_models(tmp_path):
    """A higher-order operator with no dense implementation stops the mode: the error is raised in oneiter's own
    code, so it is an internal error (exit 3), never the model's (exit 2)."""
    from torch._higher_order_ops.utils import autograd_not_implemented
    from torch._ops import HigherOrderOperator

    from oneiter.errors import user_code

    class Opaque(HigherOrderOperator):
        def __call__(self, t):
            return super().__call__(t)

    hop = Opaque("oneiter_test_opaque")
    hop.py_impl(torch._C.DispatchKey.Autograd)(autograd_not_implemented(hop, deferred_error=True))
    writer = BackgroundWriter(tmp_path / "ref.h5", {"model": "test"})

    def forward(t):  # the model's own code calls it
        return hop(t)

    with pytest.raises(NotImplementedError, match="cannot run the higher-order operator oneiter_test_opaque"):
        with RandomRecorder(TensorSink(writer)), user_code("the forward"):
            forward(torch.ones(2))
    writer.close({})
