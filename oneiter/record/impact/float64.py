"""A fixed call's float64 recomputation on the trusted path, and the live children it runs, as autograd nodes.

Where this sits: `fixed_call.py` decides which call is fixed and keeps the books (which call of a module this is, what
its live forward called); this module computes. A fixed call `M` becomes one autograd node (`_Fixed`) whose forward is
`M`'s own code rerun on the CPU in float64 — the calibration's route (`record/modes/trusted.py`: torch's own CPU
kernels, oneiter's faults and `--fallback` stepping aside), autocast off, from the very values `M` received in this
run (copied when the call began, before anything could write them in place), with its own parameters cast to float64
(differentiably: their gradients go to the live parameters) and its own buffers as they were when the call began;
its outputs are cast to the dtype and device the live ones had. Its backward backpropagates the gradient arriving at
those outputs through the float64 graph, on the trusted path again, and hands back the gradients w.r.t. `M`'s inputs
in their dtypes: its input gradients are what its own code computes from what it receives.

Each module `M`'s own code calls (a child) runs as it ran live, in a node of its own (`_LiveChild`): its inputs cast
to the dtypes and device they had live, under the run's autocast and modes, the trusted path paused; its outputs cast
to float64 for `M`'s code; in backward, the child's own live backward, its parameters' gradients accumulated as the
run's are. So fixing `M` removes `M`'s own error and nothing else.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from oneiter.record.capture.recompute import checkpoint_disabled
from oneiter.record.local.rerun import rel_l2
from oneiter.record.modes import trusted
from oneiter.runtime import host_random

__all__ = ["float64_copy", "own_tensors", "in_float64", "fixed_output", "live_child", "Unfixable", "FixRecord",
           "moved_forward"]

_CPU = torch.device("cpu")


class Unfixable(Exception):
    """The call cannot be fixed in this run; the message says why (the impact table keeps it)."""


def float64_copy(value: Any) -> Any:
    """A tensor on the CPU, floating ones in float64, detached and copied (anything else as it is)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.detach().to(_CPU, torch.float64, copy=True)
    return value.detach().to(_CPU, copy=True)


def own_tensors(module, called: set[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parameters, buffers) of `module`'s own code by name relative to it: its own, and those of submodules it never
    called in this run (`nn.MultiheadAttention` reads `out_proj.weight` without calling `out_proj`)."""
    params, buffers = {}, {}

    def walk(mod, prefix: str) -> None:
        for name, p in mod._parameters.items():
            if p is not None:
                params[prefix + name] = p
        for name, b in mod._buffers.items():
            if b is not None:
                buffers[prefix + name] = b
        for name, child in mod._modules.items():
            if child is not None and id(child) not in called:
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return params, buffers


@dataclass
class FixRecord:
    """What a float64 recomputation touched: the live parameters it read (cast to float64), and the live buffers it
    used float64 copies of (written back when it is done)."""

    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)  # (live buffer, float64 copy, its value when the call began)


@contextmanager
def in_float64(module, called: set[int], record: FixRecord) -> Iterator[None]:
    """`module`'s own parameters as float64 casts of the live ones (differentiable) and its own buffers as float64
    copies, for the block (`_reparametrize_module`, what `torch.func.functional_call` uses)."""
    params, buffers = own_tensors(module, called)
    swapped = {}
    for name, p in params.items():
        swapped[name] = p.to(_CPU, torch.float64) if p.is_floating_point() else p.detach().to(_CPU)
        if p.requires_grad:
            record.params.append(p)
    for name, b in buffers.items():
        copy = float64_copy(b)
        record.buffers.append((b, copy, copy.clone()))
        swapped[name] = copy
    with _reparametrize_module(module, swapped, strict=False):
        yield


def write_back(record: FixRecord) -> None:
    """Each buffer the float64 recomputation changed (BatchNorm's running statistics), into the live one."""
    with torch.no_grad():
        for live, copy, before in record.buffers:
            if not torch.equal(copy, before):
                live.data.copy_(copy.to(live.device, live.dtype))


class _Continue(TorchDispatchMode):
    """A random-op replayer's dispatch, entered again inside a child that runs live (no check on leaving it)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.inner.__torch_dispatch__(func, types, args, kwargs)


@contextmanager
def _autocast_off(*device_types: str) -> Iterator[None]:
    with ExitStack() as stack:
        for kind in {*device_types, "cpu"}:
            if torch.amp.is_autocast_available(kind):
                stack.enter_context(torch.autocast(device_type=kind, enabled=False))
        yield


@contextmanager
def _live(replayer, autocast) -> Iterator[None]:
    """The run's own code again, inside a trusted recomputation: the routing mode off, the recomputation's random
    values continued, the run's autocast (`autocast`: (device type, dtype) or None), the trusted path paused."""
    with ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        if replayer is not None:
            stack.enter_context(_Continue(replayer))
        stack.enter_context(trusted.paused())
        if autocast is not None:
            stack.enter_context(torch.autocast(device_type=autocast[0], dtype=autocast[1]))
        yield


@contextmanager
def trusted_path(frame, replayer, device_type: str) -> Iterator[None]:
    """Where a fixed call's float64 recomputation runs: outer modes off, gradients on, autocast off, checkpointing run
    straight, the random generators where they were when the call began (and back after), its random values the ones
    the call drew, torch's own CPU kernels (`trusted.running`)."""
    found = host_random.state()
    with ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        stack.enter_context(torch.enable_grad())
        stack.enter_context(checkpoint_disabled())
        stack.enter_context(_autocast_off(device_type))
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU's; a device's a live child draws from:
        if device_type != "cpu" and hasattr(getattr(torch, device_type, None), "get_rng_state"):
            stack.enter_context(torch.random.fork_rng(device_type=device_type))
        torch.set_rng_state(frame.rng)
        host_random.set_state(frame.host)
        if replayer is not None:
            stack.enter_context(replayer)
        stack.enter_context(trusted.running(True))
        try:
            yield
        finally:
            host_random.set_state(found)


def _floating(leaves: list) -> list[int]:
    return [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _grad_inputs(leaves: list) -> list[int]:
    """Positions of the floating tensors a gradient flows back to (a tensor in several places once: its first)."""
    seen, found = set(), []
    for i in _floating(leaves):
        if leaves[i].requires_grad and id(leaves[i]) not in seen:
            seen.add(id(leaves[i]))
            found.append(i)
    return found


def fixed_output(compute, live_inputs: tuple, output: Any, check_backward=None) -> Any:
    """`output` (the live call's) with every floating tensor replaced by the float64 recomputation's, cast as the
    live one is. `live_inputs`: the call's flattened args and kwargs as received; `compute.copies`: their float64
    copies, taken when the call began; `compute(leaves64)` runs the recomputation on those and returns (its output,
    what it touched, the anchor its live children hang on). `check_backward(moved)`, when given, is told in backward
    how far the fixed input gradients are from the live call's own (the largest rel_l2 over its inputs)."""
    leaves, spec = tree_flatten(output)
    flat_in = list(live_inputs)
    grads = _grad_inputs(flat_in)
    info = _FixedInfo(compute, flat_in, grads, leaves, spec, check=check_backward)
    anchor = torch.zeros((), requires_grad=True)  # the node is in the graph even when no input takes a gradient
    values = _fixed().apply(info, anchor, *[flat_in[i] for i in grads])
    fixed = list(leaves)
    for i, value in zip(info.positions, values, strict=True):
        fixed[i] = value
    return tree_unflatten(fixed, spec)


@dataclass
class _FixedInfo:
    compute: Any
    inputs: list  # the live flattened inputs (as received)
    grads: list[int]  # positions of those a gradient flows back to
    live_out: list
    spec: Any
    positions: list[int] = field(default_factory=list)
    outs64: list = field(default_factory=list)
    leaves64: list = field(default_factory=list)
    record: FixRecord | None = None
    anchor64: Any = None
    check: Any = None


def _run_fixed(info: _FixedInfo) -> tuple:
    """The forward of a `_Fixed` node: the recomputation, its outputs checked against the live call's structure."""
    leaves64 = list(info.compute.copies)  # taken when the call began: nothing it wrote in place since is in them
    for i in info.grads:
        leaves64[i] = leaves64[i].requires_grad_()
    info.leaves64 = leaves64
    out, info.record, info.anchor64 = info.compute(leaves64)
    out_leaves, spec = tree_flatten(out)
    info.positions = _floating(info.live_out)
    if spec != info.spec or _floating(out_leaves) != info.positions:
        raise Unfixable("its float64 recomputation returns another structure than the live call")
    for i in info.positions:
        if tuple(out_leaves[i].shape) != tuple(info.live_out[i].shape):
            raise Unfixable(f"its float64 recomputation's output has shape {list(out_leaves[i].shape)}, the live "
                            f"call's {list(info.live_out[i].shape)}")
    info.outs64 = [out_leaves[i] for i in info.positions]
    return tuple(o.detach().to(info.live_out[i].device, info.live_out[i].dtype, copy=True)
                 for o, i in zip(info.outs64, info.positions, strict=True))


def _backward_fixed(info: _FixedInfo, grads: tuple) -> list:
    """The gradients w.r.t. the fixed call's inputs: the float64 graph's, on the trusted path; its parameters'
    gradients accumulated into the live ones."""
    pairs = [(o, g.to(_CPU, torch.float64)) for o, g in zip(info.outs64, grads, strict=True)
             if g is not None and o.requires_grad]
    assert info.record is not None  # the forward (`_run_fixed`) set it
    targets = [info.leaves64[i] for i in info.grads] + [p for p in info.record.params] + [info.anchor64]
    if pairs:
        with _disable_current_modes(), _autocast_off(), trusted.running(True):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=targets)
    back = []
    for i in info.grads:
        grad = info.leaves64[i].grad
        back.append(None if grad is None else grad.to(info.inputs[i].device, info.inputs[i].dtype))
    if info.check is not None:
        info.check(_moved_backward(info, grads, back))
    return back


def _moved_backward(info: _FixedInfo, grads: tuple, fixed: list) -> float:
    """How far the fixed input gradients are from what the live call's own backward gives for the same output
    gradients (its graph is still there: the live outputs the fix replaced)."""
    pairs = [(info.live_out[i], g) for i, g in zip(info.positions, grads, strict=True)
             if g is not None and info.live_out[i].requires_grad]
    inputs = [info.inputs[i] for i in info.grads]
    if not pairs or not inputs:
        return 0.0
    with _live(None, None):
        live = torch.autograd.grad([o for o, _ in pairs], inputs, [g.to(o.dtype) for o, g in pairs],
                                   retain_graph=True, allow_unused=True)
    moved = [rel_l2(a, b) for a, b in zip(live, fixed, strict=True) if a is not None and b is not None]
    return max(moved, default=0.0)


def moved_forward(live: Any, fixed: Any) -> float:
    """How far a fixed call's outputs are from its live ones (the largest rel_l2 over its floating outputs)."""
    a, b = tree_flatten(live)[0], tree_flatten(fixed)[0]
    return max((rel_l2(x, y) for x, y in zip(a, b, strict=False) if isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor) and x.is_floating_point()), default=0.0)


@functools.lru_cache(maxsize=None)
def _fixed():
    class Fixed(torch.autograd.Function):
        """Forward: the fixed call's float64 recomputation, cast as the live outputs are. Backward: its float64
        gradients w.r.t. the call's inputs."""

        @staticmethod
        def forward(ctx, info: _FixedInfo, anchor, *inputs):
            ctx.info = info
            return _run_fixed(info)

        @staticmethod
        def backward(ctx, *grads):
            return (None, None, *_backward_fixed(ctx.info, grads))

    return Fixed


def live_child(orig, module, entry_dtypes, args: tuple, kwargs: dict, *, world, anchor64, fallback_dtype):
    """A call the fixed call's float64 code makes (`module(*args, **kwargs)`, `orig` its forward), run as it ran live:
    its float64 inputs cast to `entry_dtypes` (the dtypes and devices its floating inputs had in the live forward,
    None when unknown: `fallback_dtype` on the model's device), its outputs back in float64."""
    leaves, spec = tree_flatten((args, kwargs))
    floating = _floating(leaves)
    if entry_dtypes is None or len(entry_dtypes) != len(floating):
        entry_dtypes = [fallback_dtype] * len(floating)
    info = _ChildInfo(orig, module, leaves, spec, dict(zip(floating, entry_dtypes, strict=True)), world)
    grads = _grad_inputs(leaves)
    info.grads = grads
    values = _child().apply(info, anchor64, *[leaves[i] for i in grads])
    out = list(info.out_leaves)
    for i, value in zip(info.positions, values, strict=True):
        out[i] = value
    return tree_unflatten([_cpu(v) for v in out], info.out_spec)


def _cpu(value):
    return value.detach().to(_CPU) if isinstance(value, torch.Tensor) and not value.is_floating_point() else value


@dataclass
class _ChildInfo:
    orig: Any
    module: Any
    leaves: list
    spec: Any
    dtypes: dict[int, tuple]
    world: Any
    grads: list[int] = field(default_factory=list)
    live_leaves: list = field(default_factory=list)
    out_leaves: list = field(default_factory=list)
    out_spec: Any = None
    positions: list[int] = field(default_factory=list)
    outs: list = field(default_factory=list)


def _run_child(info: _ChildInfo) -> tuple:
    live = []
    for i, value in enumerate(info.leaves):
        if i in info.dtypes:
            dtype, device = info.dtypes[i]
            value = value.detach().to(device, dtype, copy=True).requires_grad_(value.requires_grad)
        elif isinstance(value, torch.Tensor):
            value = value.detach().to(info.world.device)
        live.append(value)
    info.live_leaves = live
    args, kwargs = tree_unflatten(live, info.spec)
    with torch.enable_grad(), info.world.live_child():
        out = info.orig(*args, **kwargs)
    info.out_leaves, info.out_spec = tree_flatten(out)
    info.positions = _floating(info.out_leaves)
    info.outs = [info.out_leaves[i] for i in info.positions]
    return tuple(o.detach().to(_CPU, torch.float64) for o in info.outs)


def _backward_child(info: _ChildInfo, grads: tuple) -> list:
    pairs = [(o, g.to(o.device, o.dtype)) for o, g in zip(info.outs, grads, strict=True)
             if g is not None and o.requires_grad]
    targets = [info.live_leaves[i] for i in info.grads] + [p for p in info.module.parameters() if p.requires_grad]
    if pairs:
        with _live(None, None):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=targets)
    back = []
    for i in info.grads:
        grad = info.live_leaves[i].grad
        back.append(None if grad is None else grad.to(_CPU, torch.float64))
    return back


@functools.lru_cache(maxsize=None)
def _child():
    class LiveChild(torch.autograd.Function):
        """Forward: a child of a fixed call run as it ran live, its outputs in float64. Backward: its live
        backward, its gradients w.r.t. its inputs in float64."""

        @staticmethod
        def forward(ctx, info: _ChildInfo, anchor, *inputs):
            ctx.info = info
            return _run_child(info)

        @staticmethod
        def backward(ctx, *grads):
            return (None, None, *_backward_child(ctx.info, grads))

    return LiveChild


live_mode = _live
