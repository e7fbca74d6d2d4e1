"""Module hooks that capture one iteration: forward inputs/outputs and the gradients around every module call.

Where this sits: `RecordingSession` attaches a `ModuleCapture` to the model, runs one iteration, and detaches it;
captured tensors are copied to the host at once and handed to the `BackgroundWriter` (`sink.py`'s `TensorSink`).
With a local-error probe (`probe.py`), the capture also keeps a small `CallRecord` per call — the call tree, the
structure of its arguments and outputs (no tensors), the random ops it ran — and hands it to the probe when the call
returns.

How the hooks avoid the known traps of module hooks:
- inputs are copied in a forward *pre*-hook, before an in-place module (ReLU(inplace=True)) overwrites them;
- no `register_full_backward_hook` (it breaks on an in-place op after the hooked module): the gradient w.r.t. a
  module's output is read with a tensor hook on that output (hooks registered before an in-place op see the
  gradient of the value before it, which is what we want); the gradient w.r.t. its inputs is this module's
  contribution only, read from the module's own autograd nodes without changing the graph (`input_grads.py`);
- every call is kept (`module@call`), so a module called twice (ResNet's shared ReLU) keeps both calls;
- keyword arguments and nested arguments are captured like positional ones (`kwarg.hidden_states`,
  `kwarg.position_embeddings.0`), and so are their gradients (`grad_kwarg.hidden_states`);
- a call made again during backward (activation checkpointing recomputes a region) is no new call: the recorded
  forward is the first execution (`recompute.py`), and a reentrant checkpoint's recomputed calls get the gradient
  hooks of the calls they repeat;
- the hooks never change a value: recording does not change the loss, the gradients or the update bits;
- a compiled block (`runtime/compiled.py`) is hooked at its call, outside its compiled code, and named as the eager
  model names it (`_orig_mod` dropped); the modules inside it run inside its graph and are not hooked.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from oneiter.format.schema import (
    BACKWARD,
    FORWARD,
    MICROBATCH,
    call_key,
    call_path,
    check_name,
    grad_name,
    layout_attrs,
    seq_kind,
)
from oneiter.record.capture.blocks import gathered_through_call
from oneiter.record.capture.input_grads import InputGradTracker, region_of, view_region
from oneiter.record.capture.recompute import Recomputations, in_backward, in_reentrant_forward, untracked
from oneiter.record.capture.sink import TensorSink
from oneiter.record.capture.structure import Skeleton, flatten, flatten_call, layout_of, skeleton, skeleton_call
from oneiter.runtime import host_random, module_state
from oneiter.runtime.compiled import Blocks, eager_name, find_blocks, outside_call
from oneiter.runtime.sharding import is_fsdp_hook, shard_of

__all__ = ["ModuleCapture", "CallRecord", "PROBED", "flatten", "next_node_number", "unscaled"]

_SIMPLE = (int, float, bool, str, type(None))
PROBED = "probed"  # a CallRecord's status once its local probe succeeded


@dataclass(eq=False)
class CallRecord:
    """What a local-error probe needs to rerun one module call (no tensors: names, dtypes and structure)."""

    key: str
    module: Any
    path: str
    call: int
    parent: "CallRecord | None"
    args: Skeleton | None
    kwargs: Skeleton | None
    random_begin: int
    random_end: int = -1
    output: Skeleton | None = None
    children: list["CallRecord"] = field(default_factory=list)
    status: str = ""  # "" until probed; PROBED, or why the call could not be probed
    internal: dict = field(default_factory=dict)  # grad name -> gradient an output got from the call itself
    identity: dict = field(default_factory=dict)  # output name -> name of the input it is (same tensor, unchanged)
    given: dict = field(default_factory=dict)  # while the call runs: id(input tensor) -> (name, version)
    # grad name -> (strides, storage offset) of the gradient an output got in the live backward, where it was not
    # contiguous (`structure.layout_of`): a rerun backpropagates the source's gradient laid out so (a channels_last
    # gradient sums in another order than a contiguous one)
    grad_layouts: dict = field(default_factory=dict)
    host_random: tuple | None = None  # Python's and numpy's generator states as the call began (host_random.py)
    # the instance attributes of its module and those under it as the call began (tensors its forward leaves there
    # for the next call: RecurrentGemma's recurrent state): a rerun starts from them (module_state.py)
    attributes: list | None = None
    # (id(module), attribute) -> storage address of each tensor the call left in its modules' attributes when it
    # returned (`module_state.left`): a later call that starts from one carries state from this call
    left: dict = field(default_factory=dict)
    # the fidelity check (probe.TeacherForcedProbe): the live call's own inputs and outputs until it is probed, then
    # whether its live outputs equal the source's bitwise, and (when they do not) copies its caller's check reruns on
    live_inputs: dict | None = None
    live_outputs: dict | None = None
    # the outputs of the collectives its own code ran live (and those of its descendants whose probe failed), by
    # path: what the fidelity check feeds its rerun when they are not the reference's (`record/modes/collectives.py`)
    live_collectives: dict = field(default_factory=dict)
    outputs_exact: bool = False
    kept_outputs: dict | None = None

    def release(self) -> None:
        """Drop what only this call's own probe needed. A probed call's children are never needed again (its
        caller forces the call as a whole); an unprobed call runs live in its caller's rerun, with its own probed
        descendants forced, so it keeps them."""
        self.args = self.kwargs = self.attributes = None
        self.live_inputs = self.live_outputs = None
        self.live_collectives = {}
        if self.status == PROBED:
            self.children = []

    def forced(self) -> list["CallRecord"]:
        """The calls a rerun of this one forces: its probed children, and, through children that could not be
        probed (they run live), their probed descendants."""
        found = []
        for child in self.children:
            if child.status == PROBED:
                found.append(child)
            else:
                found.extend(child.forced())
        return found


def unscaled(grad, scale: float):
    """A gradient of a loss multiplied by `scale` (a GradScaler's power of two), as the unscaled loss gives it: divided
    by `scale`, exactly (float16 in float32, whose exponent range holds it; bfloat16 and float32 have the range)."""
    if scale == 1.0:
        return grad
    import torch

    return (grad.float() if grad.dtype == torch.float16 else grad.detach()) / scale


class ModuleCapture:
    """Forward pre/post hooks on every selected module, and tensor hooks for the gradients around each call."""

    def __init__(self, model, sink: TensorSink, select: Callable[[str], bool] = lambda _path: True, probe=None):
        self.model = model
        self.sink = sink
        self.select = select
        self.probe = probe  # a local-error probe (probe.py) given each call when it returns, or None
        self.random_count: Callable[[], int] = lambda: 0  # the running random-op count (set by the session)
        self.grad_scale = 1.0  # a GradScaler's factor on the loss: gradients are stored divided by it (`unscaled`)
        self.num_calls = 0
        self.microbatch = 0  # the microbatch whose forward runs: each call's own (docs/format.md "Microbatches")
        self.call_begins: list[Callable[[int], None]] = []  # told the microbatch of each call that begins (p2p.py)
        self.seqs: dict[tuple[str, str], int] = {}  # (call key, input|output|grad_output|grad_input) -> order
        self._suspended = False  # True while a probe reruns a call: its calls are not part of the iteration
        self._handles: list = []
        self._names: dict[int, str] = {}
        self._calls_per_module: dict[str, int] = {}
        self._used_calls: dict[str, set[int]] = {}  # a replay paired with its reference (`pair_with`): indices given
        self._stack: list[tuple[str, CallRecord | None, int, str]] = []  # open calls: key, record, first node, path
        self.node_ranges: list[tuple[int, int, str]] = []  # per finished call: [first, end) node numbers, key
        self.node_gaps: list[tuple[int, int]] = []  # [first, end) numbers of nodes the hooks themselves created
        self._seq = itertools.count()
        self._input_grads = InputGradTracker()
        self._views: list[list] = []  # the outputs `_output_hook` watches for an in-place change, until detach
        self._pending_grads: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.recomputations = Recomputations()
        self.blocks = Blocks()  # the model's compiled blocks, found on attach

    def __enter__(self) -> "ModuleCapture":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def attach(self) -> None:
        self.blocks = find_blocks(self.model)
        for raw, module in self.model.named_modules():
            path = eager_name(raw)
            if self.blocks.hides(raw) or not self.select(path):
                continue
            check_name(path, "module")
            self._names[id(module)] = path
            # first of the module's own pre-hooks (a call is everything `module(...)` runs, as its rerun runs it:
            # torch's tensor-parallel styles convert inputs there), after FSDP2's (parameter management, which
            # reruns leave out); the post-hook last; both outside any compiled code of the module
            self._handles.extend(outside_call(module, self._pre_hook, self._post_hook, prepend=True))
            if path in self.blocks.by_path:  # a compiled FSDP2 unit's rerun needs its parameters gathered
                self._handles += gathered_through_call(module, lambda: self._suspended or in_backward())
            hooks = module._forward_pre_hooks
            for key in reversed([k for k, h in hooks.items() if is_fsdp_hook(h)]):
                hooks.move_to_end(key, last=False)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._input_grads.remove()
        for held in self._views:
            held.clear()
        self._views.clear()
        self._pending_grads.clear()
        self._stack.clear()

    def suspended(self):
        """A context in which calls are not captured (a probe's rerun)."""
        return _Suspend(self)

    def is_suspended(self) -> bool:
        """Whether a probe's rerun is running (its calls are not part of the iteration)."""
        return self._suspended

    def open_calls(self) -> list[tuple[str, str]]:
        """(key, module path) of the calls whose forward has begun and not returned, outermost first: where an
        exception raised in forward is (the post-hooks never ran)."""
        return [(key, path) for key, _record, _first, path in self._stack]

    def owner(self) -> tuple[str, "CallRecord | None"]:
        """The innermost open call (key, its CallRecord or None without a probe); ("", None) outside every call."""
        if not self._stack:
            return "", None
        key, record, _first, _path = self._stack[-1]
        return key, record

    def owner_of_node(self, number: int) -> str | None:
        """The call whose forward created autograd node `number` (`call_of_node`); None: none (the loss, a hook)."""
        return self.call_of_node(number)

    def recomputing(self) -> bool:
        """Whether activation checkpointing is running a region's forward again (in backward)."""
        return self.recomputations.recomputing()

    def next_seq(self) -> int:
        """The next number of the capture order (each call's `seq_*` attributes, a collective's `seq`)."""
        with self._lock:
            return next(self._seq)

    def open_block(self) -> str | None:
        """The eager path of the innermost compiled block whose call is open (None: none is)."""
        for _key, _record, _first, path in reversed(self._stack):
            if path in self.blocks.by_path:
                return path
        return None

    def path_of(self, module) -> str | None:
        """The recorded path of a module of the model (None: not recorded)."""
        return self._names.get(id(module))

    def call_of_node(self, number: int) -> str | None:
        """The innermost call whose forward created the autograd node numbered `number` (`Node._sequence_nr()`),
        or None (created outside every recorded call: the loss)."""
        best = None
        for first, end, key in self.node_ranges:
            if first <= number < end and (best is None or first > best[0]):
                best = (first, key)
        return best[1] if best is not None else None

    # -- forward ----------------------------------------------------------------------------------------------------
    def _pre_hook(self, module, args: tuple, kwargs: dict):
        if self._suspended:
            return None
        before = next_node_number()
        if in_backward():
            self._begin_recomputed(module, args, kwargs)
        else:
            self._begin_call(module, args, kwargs)
        self._note_gap(before)
        return None

    def _post_hook(self, module, args, kwargs, output):
        if self._suspended:
            return None
        before = next_node_number()
        if in_backward():
            self._end_recomputed(output)
        else:
            self._end_call(output)
        self._note_gap(before)
        return None

    def _note_gap(self, before: int) -> None:
        """Autograd nodes a hook itself created (the input-gradient anchor, a probe's rerun): not the model's."""
        after = next_node_number()
        if after > before >= 0:
            self.node_gaps.append((before, after))

    def model_node_index(self, number: int, first: int) -> int:
        """How many nodes the model itself created from node number `first` up to `number`: the hooks' own nodes
        (`node_gaps`) left out, so a rerun of the forward without hooks finds the same node at `first + index`."""
        hooks = sum(max(0, min(end, number) - max(begin, first)) for begin, end in self.node_gaps)
        return number - first - hooks

    def pair_with(self, calls: list[tuple[str, dict]]) -> None:
        """A replay: number each module's calls as the reference's (`calls`: its (key, attrs)) where the order
        differs. A call is given the index of the reference's call of the module with the same non-tensor arguments
        (`arg.*` attributes): its own index when that one has them, else the first unused one that does, else the
        first unused index from its own. ModernBERT computes its rotary embeddings per layer type in the order of
        `set(config.layer_types)`, which Python's per-process string hashing decides: the reference's call 0 may be
        the target's call 1."""
        found: dict[str, dict[int, dict]] = {}
        for _key, attrs in calls:
            found.setdefault(str(attrs["module"]), {})[int(attrs["call"])] = _simple_args(attrs)
        self._reference_calls = {m: [d.get(i) for i in range(max(d) + 1)] for m, d in found.items()}

    def _call_index(self, path: str, simple: dict) -> int:
        count = self._calls_per_module.get(path, 0)
        self._calls_per_module[path] = count + 1
        theirs = getattr(self, "_reference_calls", {}).get(path)
        if theirs is None:
            return count
        used = self._used_calls.setdefault(path, set())
        order = [count, *(i for i in range(len(theirs)) if i != count)]
        pick = next((i for i in order if i < len(theirs) and i not in used and theirs[i] == simple), None)
        if pick is None:
            pick = next(i for i in itertools.count(count) if i not in used)
        used.add(pick)
        return pick

    def _begin_call(self, module, args: tuple, kwargs: dict) -> None:
        path = self._names[id(module)]
        named = list(flatten_call(args, kwargs))
        simple = {f"arg.{name}": "None" if value is None else value for name, value in named
                  if isinstance(value, _SIMPLE)}
        call = self._call_index(path, _simple_args(simple))
        key = call_key(path, call)
        parent_key, parent = self._stack[-1][:2] if self._stack else ("", None)
        begin = self.random_count()
        attrs = {"module": path, "call": call, "exec_index": self.num_calls, "class_name": type(module).__name__,
                 "parent": parent_key, "random_begin": begin, **simple}
        if self.microbatch:  # absent: microbatch 0 (a recording of one microbatch is written as before)
            attrs[MICROBATCH] = self.microbatch
        for told in self.call_begins:
            told(self.microbatch)
        self.num_calls += 1
        group = call_path(key, FORWARD)
        for name, value in named:
            if not isinstance(value, _SIMPLE):
                self.sink.put(group, name, value, _layout(value))
        self._mark_seq(key, "input", attrs)
        self.sink.writer.attrs(call_path(key), attrs)
        self._pending_grads[key] = self._input_grads.start([(grad_name(n), v) for n, v in named])
        self.recomputations.forward_begin(key, module, next_node_number())
        record = None
        if self.probe is not None:
            # inside a reentrant checkpoint the region runs without gradients: its structure is taken as the
            # recomputation, which differentiates it, will have it
            as_if_grad = not _grad_enabled() and in_reentrant_forward()
            pos, kw = skeleton_call(args, kwargs, as_if_grad=as_if_grad)
            record = CallRecord(key, module, path, call, parent, pos, kw, begin, host_random=host_random.state(),
                                attributes=module_state.state(module))
            record.given = {id(v): (n, v._version) for n, v in named if _is_tensor(v)}
            if getattr(self.probe, "CHECKS_LIVE", False):  # the live inputs, before an in-place call changes them
                record.live_inputs = {n: shard_of(v).detach().clone() for n, v in named if _is_tensor(v)}
            if parent is not None:
                parent.children.append(record)
        self._stack.append((key, record, next_node_number(), path))

    def _end_call(self, output) -> None:
        key, record, first, _path = self._stack.pop()
        self.recomputations.forward_end()
        self.node_ranges.append((first, next_node_number(), key))
        group = call_path(key, FORWARD)
        named = list(flatten(output, "output"))
        for name, value in named:
            self.sink.put(group, name, value, _layout(value))
        self._hook_grads(key, named, self._pending_grads.pop(key, None), record)
        attrs: dict[str, Any] = {"random_end": self.random_count()}
        self._mark_seq(key, "output", attrs)
        self.sink.writer.attrs(call_path(key), attrs)
        if record is not None:
            record.random_end = attrs["random_end"]
            record.left = module_state.left(record.attributes)
            as_if_grad = not _grad_enabled() and in_reentrant_forward()
            record.output = skeleton(output, "output", as_if_grad=as_if_grad)
            # outputs that are an input, unchanged (Identity, dropout with p=0): a forced rerun passes them on
            for name, value in named:
                hit = record.given.get(id(value)) if _is_tensor(value) else None
                if hit is not None and hit[1] == value._version:
                    record.identity[name] = hit[0]
            record.given = {}
            if record.live_inputs is not None:
                record.live_outputs = {n: shard_of(v).detach() for n, v in named if _is_tensor(v)}
            with self.suspended(), untracked():
                self.probe.after_call(record)

    def _hook_grads(self, key: str, named: list, pending, record: "CallRecord | None" = None) -> None:
        """Gradient hooks of one call: on its outputs (grad_output) and on its own nodes (grad_input). `record`:
        the call's probe record, which keeps the layout of each output's live gradient (`CallRecord.grad_layouts`).
        """
        for name, value in named:
            if _wants_grad(value):
                _output_hook(value, self._grad_hook(key, grad_name(name), record), self._views)
        self._input_grads.finish(pending, [v for _, v in named], self._input_grad_sink(key))

    # -- recomputation (activation checkpointing) ----------------------------------------------------------------------
    def _begin_recomputed(self, module, args: tuple, kwargs: dict) -> None:
        """A call recomputed in backward: no new call. Mapped onto its first execution (a reentrant checkpoint's
        region, whose forward ran without gradients), it gets that call's gradient hooks."""
        frame = self.recomputations.begin(module, next_node_number())
        if frame.call is not None:
            named = [(grad_name(n), v) for n, v in flatten_call(args, kwargs)]
            frame.pending = (self._input_grads.start(named), next_node_number())

    def _end_recomputed(self, output) -> None:
        frame = self.recomputations.end()
        if frame is None or frame.call is None or frame.pending is None:
            return
        pending, first = frame.pending
        self.node_ranges.append((first, next_node_number(), frame.call.key))
        self._hook_grads(frame.call.key, list(flatten(output, "output")), pending)

    def _input_grad_sink(self, key: str):
        hooks: dict[str, Callable] = {}

        def on_grad(name: str, grad) -> None:
            hooks.setdefault(name, self._grad_hook(key, name))(grad)

        return on_grad

    # -- backward ---------------------------------------------------------------------------------------------------
    def _grad_hook(self, key: str, name: str, record: "CallRecord | None" = None):
        import torch

        group = call_path(key, BACKWARD)

        checks = getattr(self.probe, "backward_checks", None)  # record/local/fidelity.py: the live gradients' digests

        def hook(grad):
            if grad is not None:
                layout = layout_of(grad) if grad.layout == torch.strided else None  # the live backward's
                if record is not None:
                    record.grad_layouts[name] = layout
                grad = unscaled(grad, self.grad_scale)
                self.sink.put(group, name, grad, layout_attrs(layout))
                if checks is not None:
                    checks.live_grad(key, name, grad)
                attrs: dict[str, Any] = {}
                self._mark_seq(key, seq_kind(name), attrs)
                if attrs:
                    self.sink.writer.attrs(call_path(key), attrs)
            return None

        return hook

    def _mark_seq(self, key: str, kind: str, attrs: dict) -> None:
        """Record the capture order of the first tensor of each kind of a call (`seq_input`, `seq_grad_output`...)."""
        with self._lock:
            if (key, kind) in self.seqs:
                return
            self.seqs[(key, kind)] = attrs[f"seq_{kind}"] = next(self._seq)


class _Suspend:
    def __init__(self, capture: ModuleCapture):
        self.capture = capture
        self.before = False

    def __enter__(self) -> None:
        self.before, self.capture._suspended = self.capture._suspended, True

    def __exit__(self, *exc) -> None:
        self.capture._suspended = self.before


def _output_hook(value, hook: Callable, views: list) -> None:
    """`hook(gradient)` once the gradient w.r.t. the output `value` is known. A tensor hook, except that torch never
    fires a hook registered on a *view* that is then changed in place (nn.Linear with a bias returns a view of its
    2-d matmul for a 3-d input, and the next module may be ReLU(inplace=True)): for a view, a pre-hook on its base's
    node stands in when the tensor hook has not fired *and the view was changed in place since* (its version moved),
    and takes the view's region of the base's gradient (the gradient w.r.t. the value before the in-place change,
    what the tensor hook would have seen). A view that is merely unused (DINOv2 returns `pooler_output`,
    `sequence_output[:, 0, :]`, which its classifier never reads) gets no gradient, as a tensor hook gives none.
    The view is held (`views`, cleared by `ModuleCapture.detach`) to read its version in backward."""
    region = view_region(value)
    if region is None:
        value.register_hook(hook)
        return
    held = [value, value._version]  # emptied once either hook has fired
    views.append(held)

    def on_view(grad):
        held.clear()
        return hook(grad)

    base = value._base
    slot = base.output_nr

    def on_base(grad_outputs):
        if held and held[0]._version != held[1] and grad_outputs[slot] is not None:
            hook(region_of(grad_outputs[slot], region))
        held.clear()
        return None

    value.register_hook(on_view)
    base.grad_fn.register_prehook(on_base)


def _simple_args(attrs: dict) -> dict[str, str]:
    """A call's non-tensor arguments (`arg.*` attributes) as strings: what a live call and a recorded one compare by
    (an HDF5 attribute reads back as a numpy scalar)."""
    return {k: str(v.item() if hasattr(v, "item") else v) for k, v in attrs.items() if k.startswith("arg.")}


def _layout(value) -> dict | None:
    """The layout attributes of a non-contiguous tensor (`schema.layout_attrs`), else None."""
    if not _is_tensor(value) or value.is_sparse or value.is_quantized or value.is_nested:
        return None
    import torch

    return layout_attrs(layout_of(value)) if value.layout == torch.strided else None


def next_node_number() -> int:
    """The sequence number the next autograd node created on this thread gets (-1 where torch cannot say)."""
    import torch

    peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return peek() if peek is not None else -1


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _wants_grad(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled()


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()
