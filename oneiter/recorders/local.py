"""Local (per-layer) error probes: each layer's own computation, free of upstream drift.

Where this sits: `ModuleCapture` calls a probe after every probed module call — leaves, and containers with
computation of their own (`capture.probed`) — (and on each gradient of a probed call's
output). Two probes, one per way of getting a trustworthy reference for that single layer:

- `TeacherForced` (record --replay, on by default): the target layer is run again on the *reference's* recorded
  inputs, and its backward on the reference's recorded output gradient. Stored as `calls/<key>/local/...`, to be
  compared with the reference file's own forward output and grad_input.
- `AgainstCPU` (record --against cpu, no reference file): the layer is recomputed on the CPU in float32 from the
  target's *own* inputs (and, in backward, its own output gradient). Stored as `calls/<key>/local/...`, to be
  compared with the same file's forward output and grad_input.

Both also measure the layer's *expected noise*: the same computation on the CPU in the target's precision (run
dtype and autocast), without faults or fallbacks, compared with the float32 reference. That rel-L2 figure is
stored as group attribute `noise.<tensor>`; compare flags a layer only when its local error is several times
above it. Reruns never change the real iteration: hooks are suspended, buffers (BatchNorm running stats) and
RNG states are restored, and torch dispatch modes (random replay) are not active during a rerun.
A layer that draws random numbers (dropout) cannot be rerun faithfully and is marked `skipped = "random"`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any

from ..fileformat import BACKWARD, CALLS, FORWARD, LOCAL
from .capture import flatten

__all__ = ["TeacherForced", "AgainstCPU"]


@contextmanager
def _isolated_rerun(module, device):
    """Suspend dispatch modes, keep buffers and RNG states unchanged; yields a dict to which `random` is set."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    dev_rng = backend.get_rng_state() if backend is not None and hasattr(backend, "get_rng_state") else None
    info: dict[str, Any] = {}
    try:
        with _disable_current_modes(), torch.enable_grad():
            yield info
    finally:
        info["random"] = not torch.equal(cpu_rng, torch.get_rng_state()) or (
            dev_rng is not None and not torch.equal(dev_rng, backend.get_rng_state())
        )
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            backend.set_rng_state(dev_rng)
        with torch.no_grad():
            for live, saved in buffers:
                # through .data: the real iteration saved these buffers for backward (BatchNorm), and a
                # version bump would make autograd reject them
                live.data.copy_(saved)


def _leaf_inputs(values: list, like: list, device, dtype_of=None):
    """Fresh inputs for a rerun: (inputs to pass, leaves to differentiate w.r.t., index of each leaf).

    `like` are the live inputs of the call: their dtype and requires_grad are copied. Each differentiable input
    is a clone of a leaf, so an in-place module can run on it.
    """
    import torch

    passed, leaves, where = [], [], []
    for i, (value, live) in enumerate(zip(values, like)):
        if not isinstance(value, torch.Tensor):
            passed.append(value)
            continue
        dtype = dtype_of(live) if dtype_of else (live.dtype if isinstance(live, torch.Tensor) else value.dtype)
        tensor = value.detach().to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        if isinstance(live, torch.Tensor) and live.requires_grad and tensor.is_floating_point():
            leaf = tensor.requires_grad_()
            leaves.append(leaf)
            where.append(i)
            tensor = leaf.clone()
        passed.append(tensor)
    return passed, leaves, where


def _rel_l2(reference, value) -> float:
    import torch

    a, b = reference.detach().double().cpu(), value.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    denom = torch.linalg.vector_norm(a).item()
    diff = torch.linalg.vector_norm(a - b).item()
    return diff / denom if denom else (0.0 if diff == 0 else float("inf"))


def _like(grads: list, outputs: list, device) -> list:
    """Each gradient on `device` in the dtype of the output it belongs to (None stays None)."""
    return [None if g is None else g.to(device, o.dtype) for g, o in zip(grads, outputs)]


def _grads(outputs: list, grad_outputs: list, leaves: list) -> list:
    import torch

    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    if not pairs or not leaves:
        return []
    return list(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True))


class _Probe:
    """Shared plumbing: where local results go, and the calibration (expected-noise) run."""

    kind = ""

    def __init__(self, sink, device, amp_dtype=None):
        self.sink = sink
        self.device = device
        self.amp_dtype = amp_dtype
        self.num_layers = 0

    def _group(self, key: str) -> str:
        return f"{CALLS}/{key}/{LOCAL}"

    def _put_outputs(self, key: str, output) -> list:
        tensors = []
        for name, value in flatten(output, "output"):
            self.sink.put(f"{self._group(key)}/{FORWARD}", name, value, dedup=False)
            tensors.append((name, value))
        return tensors

    def _put_grads(self, key: str, grads: list, where: list) -> None:
        for grad, index in zip(grads, where):
            if grad is not None:
                self.sink.put(f"{self._group(key)}/{BACKWARD}", f"grad_input.{index}", grad, dedup=False)

    def _cpu_module(self, module, dtype=None):
        """A CPU module to compute a reference with, without hooks (faults, capture): a leaf itself on a CPU run
        (its `.forward` runs no hooks), else a hook-free copy made for this call and dropped after it, so at most
        one container's weights are copied at a time (a teacher-forced rerun; --against keeps its copies alive
        until the backward it needs them for)."""
        if self.device.type == "cpu" and dtype is None and next(module.children(), None) is None:
            return module
        clone = _copy_without_hooks(module).to("cpu")
        return clone.to(dtype) if dtype is not None else clone

    def _autocast_cpu(self, enabled: bool):
        import torch

        return torch.autocast("cpu", dtype=self.amp_dtype or torch.bfloat16, enabled=enabled and self.amp_dtype is not None)

    def _write_attrs(self, key: str, attrs: dict) -> None:
        self.sink.writer.attrs(self._group(key), {"kind": self.kind, **attrs})


def _copy_without_hooks(module):
    """A deep copy of `module` with no hooks anywhere in it (oneiter's capture, faults, a user's): hooks hold
    references to live recorder objects, and a reference computation must not run them."""
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
    saved = [(m, {n: getattr(m, n) for n in names if hasattr(m, n)}) for m in module.modules()]
    try:
        for m, hooks in saved:
            for n, value in hooks.items():
                setattr(m, n, type(value)())
        return copy.deepcopy(module)
    finally:
        for m, hooks in saved:
            for n, value in hooks.items():
                setattr(m, n, value)


def _no_torch_function():
    import torch

    return torch._C.DisableTorchFunction()


class TeacherForced(_Probe):
    """Rerun each probed call of the target on the reference's recorded inputs and output gradients."""

    kind = "teacher_forced"

    def __init__(self, ref, sink, device, amp_dtype=None, calibrate: bool = True):
        super().__init__(sink, device, amp_dtype)
        self.ref = ref
        self.calibrate = calibrate

    def _ref_inputs(self, key: str, args: tuple) -> list | None:
        import torch

        group = f"{CALLS}/{key}/{FORWARD}"
        if not self.ref.has(group):
            return None
        values = []
        for i, live in enumerate(args):
            path = f"{group}/input.{i}"
            if isinstance(live, torch.Tensor):
                if not self.ref.has(path):
                    return None
                values.append(self.ref.tensor(path))
            else:
                values.append(live)
        return values

    def _ref_grad_outputs(self, key: str, output) -> list:
        """The reference's gradient of each output of this call (CPU, as recorded; None where not recorded)."""
        paths = [f"{CALLS}/{key}/{BACKWARD}/grad_{name}" for name, _ in flatten(output, "output")]
        return [self.ref.tensor(path) if self.ref.has(path) else None for path in paths]

    def after_forward(self, module, key: str, args: tuple, kwargs: dict, output) -> None:
        values = self._ref_inputs(key, args)
        if values is None or kwargs:
            self._write_attrs(key, {"skipped": "inputs not recorded in the reference" if values is None else "kwargs"})
            return
        passed, leaves, where = _leaf_inputs(values, list(args), self.device)
        with _isolated_rerun(module, self.device) as info:
            out = module(*passed)
            outs = [t for _, t in flatten(out, "output")]
            ref_grads = self._ref_grad_outputs(key, out)
            grads = _grads(outs, _like(ref_grads, outs, self.device), leaves)
        if info["random"]:
            self._write_attrs(key, {"skipped": "random"})
            return
        self._put_outputs(key, out)
        self._put_grads(key, grads, where)
        self.num_layers += 1
        self._write_attrs(key, self._noise(module, key, values, args, ref_grads) if self.calibrate else {})

    def _noise(self, module, key: str, values: list, args: tuple, ref_grads: list) -> dict:
        """Expected noise: the reference layer in the target's precision on the CPU, vs the reference's values."""
        cpu = self._cpu_module(module)
        passed, leaves, cal_where = _leaf_inputs(values, list(args), _cpu())
        with _isolated_rerun(cpu, _cpu()), _no_torch_function(), self._autocast_cpu(True):
            out = cpu.forward(*passed)
            named = list(flatten(out, "output"))
            grads = _grads([t for _, t in named], _like(ref_grads, [t for _, t in named], _cpu()), leaves)
        attrs = {}
        for name, value in named:
            path = f"{CALLS}/{key}/{FORWARD}/{name}"
            if self.ref.has(path):
                attrs[f"noise.{name}"] = _rel_l2(self.ref.tensor(path), value)
        for grad, index in zip(grads, cal_where):
            path = f"{CALLS}/{key}/{BACKWARD}/grad_input.{index}"
            if grad is not None and self.ref.has(path):
                attrs[f"noise.grad_input.{index}"] = _rel_l2(self.ref.tensor(path), grad)
        return attrs

    def on_grad_output(self, key: str, name: str, grad) -> None:
        """Teacher forcing takes the reference's output gradient, read in `after_forward`: nothing to do here."""


class AgainstCPU(_Probe):
    """Recompute each probed call on the CPU in float32 from the target's own inputs and output gradients."""

    kind = "against_cpu"

    def __init__(self, sink, device, amp_dtype=None):
        super().__init__(sink, device, amp_dtype)
        self._pending: dict[str, tuple] = {}

    def _run(self, module, args: tuple, fp32: bool):
        """Forward on the CPU: float32 without autocast, or in the target's precision (calibration)."""
        import torch

        cpu = self._cpu_module(module, torch.float32) if fp32 else self._cpu_module(module)
        as_fp32 = (lambda _live: torch.float32) if fp32 else None
        passed, leaves, where = _leaf_inputs(list(args), list(args), _cpu(), as_fp32)
        with _isolated_rerun(cpu, _cpu()) as info, _no_torch_function(), self._autocast_cpu(not fp32):
            out = cpu.forward(*passed)
        return out, leaves, where, info["random"]

    def after_forward(self, module, key: str, args: tuple, kwargs: dict, output) -> None:
        if kwargs:
            self._write_attrs(key, {"skipped": "kwargs"})
            return
        out, leaves, where, random = self._run(module, args, fp32=True)
        if random:
            self._write_attrs(key, {"skipped": "random"})
            return
        cal_out, cal_leaves, _, _ = self._run(module, args, fp32=False)
        named = list(flatten(out, "output"))
        self._put_outputs(key, out)
        attrs = {f"noise.{n}": _rel_l2(v, c) for (n, v), (_, c) in zip(named, flatten(cal_out, "output"))}
        self._write_attrs(key, attrs)
        self.num_layers += 1
        if len(named) == 1 and leaves and named[0][1].requires_grad:
            self._pending[key] = (named[0][1], leaves, where, next(iter(flatten(cal_out, "output")))[1], cal_leaves)

    def on_grad_output(self, key: str, name: str, grad) -> None:
        """The target's gradient of this layer's output arrived: run the CPU backward from it."""
        import torch

        pending = self._pending.pop(key, None) if name == "grad_output" else None
        if pending is None:
            return
        out, leaves, where, cal_out, cal_leaves = pending
        with torch.enable_grad():
            grads = torch.autograd.grad([out], leaves, [grad.detach().to("cpu", torch.float32)], allow_unused=True)
            cal = torch.autograd.grad([cal_out], cal_leaves, [grad.detach().to("cpu", cal_out.dtype)], allow_unused=True)
        self._put_grads(key, list(grads), where)
        attrs = {f"noise.grad_input.{i}": _rel_l2(g, c) for g, c, i in zip(grads, cal, where) if g is not None and c is not None}
        self._write_attrs(key, attrs)


def _cpu():
    import torch

    return torch.device("cpu")
