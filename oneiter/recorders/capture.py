"""Module hooks that capture one iteration: forward inputs/outputs and the gradients around every module call.

Where this sits: `record.py` attaches a `ModuleCapture` to the model, runs one `train_step`, and detaches it;
captured tensors are copied to the host at once and handed to the `BackgroundWriter`.

How the hooks avoid the known traps (../shared/NOTES.md):
- inputs are copied in a forward *pre*-hook, before an in-place module (ReLU(inplace=True)) overwrites them;
- no `register_full_backward_hook` (it breaks on an in-place op after the hooked module): the gradient w.r.t. a
  module's output is read with a tensor hook on that output (hooks registered before an in-place op see the
  gradient of the value before it, which is what we want); the gradient w.r.t. its inputs is this module's
  contribution only, read from the module's own autograd nodes without changing the graph (`input_grads.py`);
- every call is kept (`module@call`), so a module called twice (ResNet's shared ReLU) keeps both calls;
- the hooks never change a value: recording does not change the loss, the gradients or the update bits.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Iterator

from ..fileformat import BACKWARD, CALLS, FORWARD, call_key, seq_kind
from .input_grads import InputGradTracker

__all__ = ["ModuleCapture", "flatten", "host_copy", "TensorSink"]

_SIMPLE = (int, float, bool, str, type(None))


def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Yield (name, leaf) for nested tuples/lists/dicts: `output`, `output.0`, `output.logits`, `input.1.0`."""
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from flatten(item, f"{prefix}.{i}")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from flatten(item, f"{prefix}.{key}")
    else:
        yield prefix, obj


def host_copy(tensor):
    """A detached, contiguous copy on the CPU: safe to keep while the original changes or is freed."""
    import torch

    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.to(device="cpu", memory_format=torch.contiguous_format, copy=True)


class TensorSink:
    """Copies tensors to the writer, storing a tensor seen before (same object, same version) as a hard link."""

    def __init__(self, writer, on_capture: Callable[[int], None] | None = None):
        self.writer = writer
        self.num_tensors = 0
        self._seen: dict[int, tuple[Any, int, str]] = {}
        self._lock = threading.Lock()
        self._on_capture = on_capture

    def put(self, group: str, name: str, tensor, attrs: dict | None = None, *, dedup: bool = True) -> None:
        """Queue `tensor` as `group/name`. `dedup=False` for parameters and buffers: a kernel may update a buffer
        in place without bumping its version counter (BatchNorm's running stats), so version equality is only
        trusted for activations and gradients."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.is_sparse or tensor.is_quantized:
            return
        path = f"{group}/{name}"
        with self._lock:
            hit = self._seen.get(id(tensor))
            if dedup and hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
                self.writer.link(group, name, hit[2])
            else:
                key = id(tensor)
                ref = weakref.ref(tensor, lambda _r, k=key, seen=self._seen: seen.pop(k, None))
                self._seen[key] = (ref, tensor._version, path)
                self.writer.tensor(group, name, host_copy(tensor), attrs)
            self.num_tensors += 1
        if self._on_capture is not None:
            self._on_capture(self.num_tensors)


class ModuleCapture:
    """Forward pre/post hooks on every selected module, and tensor hooks for the gradients around each call."""

    def __init__(self, model, sink: TensorSink, select: Callable[[str], bool] = lambda _path: True, probe=None):
        self.model = model
        self.sink = sink
        self.select = select
        self.probe = probe  # a local-error probe (recorders/local.py) run after each probed call, or None
        self._suspended = False  # True while a probe reruns a layer: its calls are not part of the iteration
        self._probed: set[int] = set()  # modules whose calls get a local-error probe
        self.num_calls = 0
        self._handles: list = []
        self._names: dict[int, str] = {}
        self._calls_per_module: dict[str, int] = {}
        self._open: dict[int, list[str]] = {}
        self._seq = itertools.count()
        self._seq_done: set[tuple[str, str]] = set()
        self._input_grads = InputGradTracker()
        self._pending_grads: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "ModuleCapture":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def attach(self) -> None:
        for path, module in self.model.named_modules():
            if not self.select(path):
                continue
            self._names[id(module)] = path
            if probed(path, module):
                self._probed.add(id(module))
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._input_grads.remove()
        self._pending_grads.clear()

    # -- forward ----------------------------------------------------------------------------------------------------
    def _pre_hook(self, module, args: tuple, kwargs: dict):
        if self._suspended:
            return None
        path = self._names[id(module)]
        call = self._calls_per_module.get(path, 0)
        self._calls_per_module[path] = call + 1
        key = call_key(path, call)
        self._open.setdefault(id(module), []).append(key)
        attrs = {"module": path, "call": call, "exec_index": self.num_calls, "class_name": type(module).__name__}
        self.num_calls += 1
        group = f"{CALLS}/{key}/{FORWARD}"
        for name, value in itertools.chain(flatten(list(args), "input"), _flatten_kwargs(kwargs)):
            if isinstance(value, _SIMPLE):
                attrs[f"arg.{name}"] = "None" if value is None else value
            else:
                self.sink.put(group, name, value)
        self._mark_seq(key, "input", attrs)
        self.sink.writer.attrs(f"{CALLS}/{key}", attrs)
        named = [(f"grad_input.{i}", a) for i, a in enumerate(args)]
        named += [(f"grad_input.{k}", v) for k, v in kwargs.items()]
        self._pending_grads[key] = self._input_grads.start(named)
        return None

    def _post_hook(self, module, args, kwargs, output):
        if self._suspended:
            return None
        key = self._open[id(module)].pop()
        group = f"{CALLS}/{key}/{FORWARD}"
        for name, value in flatten(output, "output"):
            self.sink.put(group, name, value)
            if _wants_grad(value):
                value.register_hook(self._grad_hook(key, f"grad_{name}"))
        outputs = [value for _, value in flatten(output, "output")]
        self._input_grads.finish(self._pending_grads.pop(key, None), outputs, self._input_grad_sink(key))
        attrs: dict[str, Any] = {}
        self._mark_seq(key, "output", attrs)
        self.sink.writer.attrs(f"{CALLS}/{key}", attrs)
        if self.probe is not None and id(module) in self._probed:
            self._suspended = True
            try:
                self.probe.after_forward(module, key, args, kwargs, output)
            finally:
                self._suspended = False
        return None

    def _input_grad_sink(self, key: str):
        hooks: dict[str, Callable] = {}

        def on_grad(name: str, grad) -> None:
            hooks.setdefault(name, self._grad_hook(key, name))(grad)

        return on_grad

    # -- backward ---------------------------------------------------------------------------------------------------
    def _grad_hook(self, key: str, name: str):
        group = f"{CALLS}/{key}/{BACKWARD}"

        def hook(grad):
            if grad is not None:
                self.sink.put(group, name, grad)
                attrs: dict[str, Any] = {}
                self._mark_seq(key, seq_kind(name), attrs)
                if attrs:
                    self.sink.writer.attrs(f"{CALLS}/{key}", attrs)
                if self.probe is not None and name.startswith("grad_output"):
                    self.probe.on_grad_output(key, name, grad)
            return None

        return hook

    def _mark_seq(self, key: str, kind: str, attrs: dict) -> None:
        """Record the capture order of the first tensor of each kind of a call (`seq_input`, `seq_grad_output`...)."""
        with self._lock:
            if (key, kind) in self._seq_done:
                return
            self._seq_done.add((key, kind))
            attrs[f"seq_{kind}"] = next(self._seq)


def probed(path: str, module) -> bool:
    """Which module calls get a local-error probe: leaves, and containers with computation of their own.

    Pure compositions (nn.Sequential, ModuleList/ModuleDict) add nothing a probe of their children misses; the
    model itself (path "") is left out because rerunning it is a second full iteration.
    """
    import torch.nn as nn

    if next(module.children(), None) is None:
        return True
    return bool(path) and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


def _flatten_kwargs(kwargs: dict) -> Iterator[tuple[str, Any]]:
    for key, value in kwargs.items():
        yield from flatten(value, f"kwarg.{key}")


def _wants_grad(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled()
