"""torch.distributed collectives: recorded per rank while the iteration runs, and forced in reruns, which never
communicate.

Where this sits: the Recorder runs the iteration's forward and backward inside a `CollectiveRecorder` (with the
random-op modes of `randomness.py`) whenever a process group is up. Every collective reaches the dispatcher as a
`c10d` op (`dist.all_reduce`, DDP's gradient buckets, FSDP2's all-gathers and reduce-scatters, Megatron-style
autograd Functions) or a functional one (`_c10d_functional`: `torch.distributed._functional_collectives`, and every
DTensor redistribution, so `torch.distributed.tensor.parallel`); the recorder lets it run, waits for it (an async
collective is complete when it is recorded; overlap is lost, values are not), and stores under
`/collectives/<index>` (`format.schema.COLLECTIVE_ATTRS`) this rank's inputs (before an in-place op overwrites
them), its outputs, the group, the op and its reduction, the phase, the module call whose own code ran it (in
backward: the call whose forward created the running autograd node) and where (the first frame of the model's code,
`DDP bucket <n>` for DDP's C++ reducer, with `via` the torch.distributed package that issued it).

A module call's rerun (`record/local/rerun.py`) runs on one rank alone, so it must not communicate: inside it a
`CollectiveForcer` answers every collective the call's own code runs (its own, and those of the descendants that
run live in it) with the outputs the source recorded for it (the reference's, in a teacher-forced replay), in the
order the call ran them, forward and backward apart; a collective the call did not run, or another op than
recorded, makes the call unprobed (`ProbeSkip`), never a hang. Like a forced child call, a collective is then an
input of the call's own code: the fidelity check feeds the rerun the collective's *live* result
(`record/local/fidelity.py`), and whether the collective itself was right is judged across ranks
(`judge/iteration/collective_verdict.py`). The recorder stays on through the optimizer's step (phase `optimizer`:
DTensor parameters whose gradients are placed otherwise, a norm's `Partial` one, are reduced there), which no rerun
runs.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import (
    BACKWARD,
    COLLECTIVES,
    FORWARD,
    collective_group,
    collective_index,
    collective_path,
)
from oneiter.record.capture.recompute import in_backward
from oneiter.record.modes.dispatch import IterationMode, compiling, is_higher_order
from oneiter.record.modes.p2p import P2P_OPS, P2PRecorder
from oneiter.runtime.sharding import dtensor_class

__all__ = ["CollectiveRecorder", "CollectiveForcer", "RecordedCollective", "recorded_collectives", "parse",
           "is_distributed", "JUDGED"]

JUDGED = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")  # an exact result is known
_REDUCE = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
OPTIMIZER_PHASE = "optimizer"  # a collective of the optimizer's step (a tensor-parallel gradient's reduction)
_PASS = ("wait_tensor", "_wrap_tensor_autograd")  # functional bookkeeping, no data moved
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_ONEITER = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
# torch.distributed's own API: a collective called through these is the caller's own
_API = ("torch.distributed.distributed_c10d", "torch.distributed.c10d_logger",
        "torch.distributed._functional_collectives", "torch.distributed._functional_collectives_impl",
        "torch.autograd.function", "torch._ops", "torch.utils._python_dispatch")
# torch code that only passes the call on: the wrapper Dynamo puts around oneiter's own dispatch modes
# (`runtime/compiled.skip_dispatch`) sits between a C++ hook's collective and the autograd engine
_PASSING = ("torch._dynamo",)


def is_distributed() -> bool:
    """Whether a default process group is up (collectives can run)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# -- what a collective is -------------------------------------------------------------------------------------------
@dataclass
class Parsed:
    """One collective call as the dispatcher sees it: what it does, on which group, reading and writing what."""

    op: str
    kernel: str
    inputs: list
    outputs: list  # the tensors it writes (c10d ops: given; functional ops: filled after it ran)
    group: Any  # the Python ProcessGroup
    reduce_op: str = ""
    root: int = -1  # a broadcast's global source rank
    in_splits: list = field(default_factory=list)
    out_splits: list = field(default_factory=list)
    functional: bool = False
    returned: Any = None  # the argument a c10d op returns (its outputs), or None
    returns: int = 0  # how many values the op returns (c10d: outputs and Work, or Work, or nothing)


def _flat(items) -> list:
    out = []
    for item in items:
        out.extend(_flat(item) if isinstance(item, (list, tuple)) else [item])
    return out


def _bind(func, args: tuple, kwargs: dict) -> dict:
    bound = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in func._schema.arguments), args, strict=False))
    bound.update(kwargs)
    return bound


def _group(value):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(value, str):
        return _resolve_process_group(value)  # type: ignore[arg-type]  # a c10d op's group name (a GroupName)
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value)
    return value


def _reduce_name(value) -> str:
    if isinstance(value, str):
        return value.lower()
    if isinstance(value, torch.ScriptObject):
        code = int(value.op())  # type: ignore[attr-defined]  # a boxed ReduceOp: its methods are not typed
        return _REDUCE[code] if 0 <= code < len(_REDUCE) else f"op{code}"
    return ""


_C10D = {  # packet -> (op, input arguments, output arguments)
    "allreduce_": ("all_reduce", "tensors", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors", "tensors"),
    "_allgather_base_": ("all_gather", "input_tensor", "output_tensor"),
    "allgather_": ("all_gather", "input_tensors", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "input_list", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "output_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", "output_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "outputs"),
    "alltoall_base_": ("all_to_all", "input", "output"),
    "alltoall_": ("all_to_all", "input_tensors", "output_tensors"),
    "broadcast_": ("broadcast", "tensors", "tensors"),
    "reduce_": ("reduce", "tensors", "tensors"),
    "gather_": ("gather", "input_tensors", "output_tensors"),
    "scatter_": ("scatter", "input_tensors", "output_tensors"),
    "send": ("send", "tensors", None),
    "recv_": ("recv", None, "tensors"),
    "recv_any_source_": ("recv", None, "tensors"),
    "barrier": ("barrier", None, None),
    "monitored_barrier_": ("barrier", None, None),
}
_FUNCTIONAL_OPS = {  # packet -> op (input argument `input` or `inputs`, a new output)
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


def _tensors(value) -> list:
    if value is None:
        return []
    return _flat(value) if isinstance(value, (list, tuple)) else [value]


def parse(func, args: tuple, kwargs: dict) -> Parsed | None:
    """The collective `func` runs, or None when it is no collective (every other op, and the functional ops'
    bookkeeping: `wait_tensor`); raises OneIterError for a communicating op oneiter does not know. Point-to-point ops
    (`send`, `recv_`) are parsed here and recorded by `p2p.py`."""
    namespace, packet = func.namespace, func.overloadpacket.__name__
    if namespace == "c10d" and packet in _C10D:
        op, source, dest = _C10D[packet]
        bound = _bind(func, args, kwargs)
        group = _group(bound.get("process_group"))
        parsed = Parsed(op, str(func), _tensors(bound.get(source)) if source else [],
                        _tensors(bound.get(dest)) if dest else [], group,
                        reduce_op=_reduce_name(bound.get("reduce_op")),
                        returned=bound.get(dest) if dest else None, returns=len(func._schema.returns))
        if op == "broadcast":
            parsed.root = _global(group, int(bound.get("root_rank", 0)))
        if packet == "alltoall_base_":
            parsed.in_splits = [int(n) for n in bound.get("input_split_sizes") or []]
            parsed.out_splits = [int(n) for n in bound.get("output_split_sizes") or []]
        return parsed
    if namespace in _FUNCTIONAL and packet in _FUNCTIONAL_OPS:
        bound = _bind(func, args, kwargs)
        group = _group(bound.get("group_name"))
        parsed = Parsed(_FUNCTIONAL_OPS[packet], str(func), _tensors(bound.get("input", bound.get("inputs"))), [],
                        group, reduce_op=_reduce_name(bound.get("reduce_op")), functional=True)
        if parsed.op == "broadcast":
            parsed.root = int(bound.get("src", 0))
        if parsed.op == "all_to_all":
            parsed.in_splits = [int(n) for n in bound.get("input_split_sizes") or []]
            parsed.out_splits = [int(n) for n in bound.get("output_split_sizes") or []]
        return parsed
    if namespace in ("c10d", *_FUNCTIONAL) and packet not in _PASS and packet != "check_for_nan":
        raise OneIterError(f"{func}: a torch.distributed op oneiter does not know how to record (every rank that runs "
                           f"it stops here, before it communicates)")
    return None


def _subclassed(types) -> bool:
    """Whether an op has DTensor arguments: the mode returns NotImplemented, so DTensor dispatches it *with the
    mode still on*, and the mode sees the collectives it runs inside (an op whose operands are placed apart
    redistributes them: a norm weight's `Partial` gradient added to its `Replicate` weight)."""
    cls = dtensor_class()
    return cls is not None and any(issubclass(t, cls) for t in types)


def _global(group, group_rank: int) -> int:
    import torch.distributed as dist

    try:
        return int(dist.get_global_rank(group, group_rank))
    except Exception:  # noqa: BLE001 - the default group: its ranks are the global ones
        return group_rank


def _ranks(group) -> list[int]:
    import torch.distributed as dist

    try:
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:  # noqa: BLE001 - a group torch.distributed does not track
        return list(range(group.size()))


def _wait(parsed: Parsed, result) -> list:
    """Wait for a collective (async ones return a Work or a tensor still being filled); its output tensors."""
    if parsed.functional:
        outs = _tensors(result)
        for tensor in outs:
            torch.ops._c10d_functional.wait_tensor(tensor)
        return outs
    work = result[-1] if isinstance(result, (tuple, list)) else result
    if work is not None:
        _unboxed_work(work).wait()
    return parsed.outputs


def _unboxed_work(work):
    if isinstance(work, torch.ScriptObject):
        from torch.distributed.distributed_c10d import Work

        return Work.unbox(work)
    return work


def _done_work(tensors: list):
    """A completed Work (boxed, as a c10d op returns it) holding `tensors`."""
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private, unstubbed

    future: torch.futures.Future[list] = torch.futures.Future()
    future.set_result(tensors)
    return _create_work_from_future(future).boxed()


def _where() -> tuple[str, str]:
    """(site, via) of the running collective: the first frame of code outside torch and oneiter (the model's line
    that ran it; "" when torch code inside an autograd node issued it), and the torch.distributed package between
    it and the collective ("" when the model's code called the API itself; "autograd" when no Python issued it: a
    C++ hook in backward, DDP's reducer)."""
    frame: types.FrameType | None = sys._getframe(2)
    via, first = "", None
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith((_TORCH, _ONEITER)):
            break
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith("torch.autograd.graph"):  # the autograd engine: no model line issued it
            return "", via or ("autograd" if first is None else via)
        if module.startswith(_PASSING):
            frame = frame.f_back
            continue
        if first is None and module.startswith("torch") and not module.startswith(_API):
            first = module
        if not via and module.startswith(("torch.distributed.", "torch.nn.parallel")) and not module.startswith(
                _API):
            via = ".".join(module.split(".")[:3])
        frame = frame.f_back
    site = "" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in " \
                                    f"{frame.f_code.co_name}"
    return site, via


def _failed(parsed: Parsed, site: str, exc: Exception) -> OneIterError:
    """The error of a collective the backend could not complete (a peer that stopped: its own error says why; a
    timeout; arguments the backend refuses): one line naming the collective, exit 2, on every rank it reaches."""
    text = " ".join(str(exc).split())[:300]
    where = f" at {site}" if site else ""
    return OneIterError(f"{parsed.op} on ranks {_ranks(parsed.group)}{where} failed on this rank: "
                        f"{type(exc).__name__}: {text} (when another rank stopped first, its error says why)")


# -- recording ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordedCollective:
    """One collective of a recording: its index, op, phase, the call that ran it, and its tensors' paths and
    shapes (inputs, outputs)."""

    index: int
    op: str
    phase: str
    call: str
    recomputed: bool
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    ancestors: tuple[str, ...] = ()
    """The calls around `call` in the recording, innermost first (a call that another run hides inside a compiled
    block runs there as that block's own code)."""

    def output_path(self, i: int) -> str:
        return collective_path(self.index, f"output.{i}")


def recorded_collectives(iteration_file) -> list[RecordedCollective]:
    """The collectives a recording holds, in order ([] for a file without any: one process, or an older oneiter)."""
    parents = {key: str(attrs.get("parent") or "") for key, attrs in iteration_file.calls()}
    found = []
    for name, attrs in iteration_file.collectives():
        index = collective_index(name)
        assert index is not None  # the names are checked on open (`format/validate.py`)
        group = collective_group(index)
        shapes = {}
        for kind in ("input", "output"):
            names = sorted((n for n in iteration_file.names_in(group) if n.startswith(kind + ".")),
                           key=lambda n: int(n.rpartition(".")[2]))
            shapes[kind] = tuple(tuple(iteration_file.shape_of(f"{group}/{n}")) for n in names)
        call = str(attrs["call"])
        found.append(RecordedCollective(index, str(attrs["op"]), str(attrs["phase"]), call,
                                        bool(attrs["recomputed"]), shapes["input"], shapes["output"],
                                        _ancestors(call, parents)))
    return found


def _ancestors(call: str, parents: dict[str, str]) -> tuple[str, ...]:
    chain: list[str] = []
    key = parents.get(call, "")
    while key and key not in chain:
        chain.append(key)
        key = parents.get(key, "")
    return tuple(chain)


class CollectiveRecorder(IterationMode):
    """Records every collective of the block into `collectives/` through a `TensorSink` (module docstring).

    `owner()` names the call whose own code runs now (key, CallRecord or None) in forward, `owner_of_node(n)` the
    call whose forward created autograd node number `n`; `recomputing()` says whether activation checkpointing is
    running a region again; `next_seq()` numbers captures in causal order. `on_output(record, phase, outputs)` gets
    each collective's output tensors by path (the probe keeps the live values its fidelity check needs)."""

    def __init__(self, sink, capture, on_output: Callable | None = None, tagged: Callable | None = None):
        super().__init__()
        self.sink, self.capture, self.on_output = sink, capture, on_output
        self.p2p = P2PRecorder(sink, lambda: int(getattr(capture, "microbatch", 0) or 0), tagged, on_output)
        getattr(capture, "call_begins", []).append(self.p2p.claim)
        self.num_ops = 0
        self.recorded: list[RecordedCollective] = []
        self.num_buckets = 0
        self.reduced_grads = False  # a C++ hook (DDP's reducer) reduced gradients over ranks in backward
        self.stepping = False  # backward is over: what runs now is the optimizer's step (phase `optimizer`)
        self.backwards = 0  # backwards of the block returned so far (the Recorder counts them)
        self._reduced_in: set[int] = set()  # the backwards (by that count) a reducer averaged gradients in
        self._per_group: dict[str, int] = {}
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_higher_order(func) or compiling():  # compiled code's operators, a compiler's own ops (`dispatch.py`)
            return self.pass_on(func, args, kwargs)
        parsed = parse(func, args, kwargs)
        if parsed is None:
            return NotImplemented if _subclassed(types) else func(*args, **kwargs)
        site, via = _where()
        with self._lock:
            index = self.num_ops
            self.num_ops += 1
        if parsed.op in P2P_OPS:  # posted now, completed (and recorded) when the caller waits: p2p.py
            return self._post(func, args, kwargs, parsed, index, site, via)
        group = collective_group(index)
        for i, tensor in enumerate(parsed.inputs):  # before an in-place op overwrites them
            self.sink.put(group, f"input.{i}", tensor)
        try:
            result = func(*args, **kwargs)
            outputs = _wait(parsed, result)
        except Exception as exc:  # noqa: BLE001 - the backend's, on the model's own arguments: never oneiter's bug
            raise _failed(parsed, site, exc) from exc
        for i, tensor in enumerate(outputs):
            # never a link: a c10d op writes its tensors in place without bumping their version counter, so the
            # sink would take the result for the input it recorded; from here on that tensor is this output
            self.sink.put(group, f"output.{i}", tensor, dedup=False)
        self._describe(index, parsed, outputs, site, via)
        return result

    def _describe(self, index: int, parsed: Parsed, outputs: list, site: str, via: str) -> None:
        backward = in_backward()
        phase = BACKWARD if backward else (OPTIMIZER_PHASE if self.stepping else FORWARD)
        key, record = ("", None) if backward or self.stepping else self.capture.owner()
        bucket = -1
        if backward:
            node = torch._C._current_autograd_node()
            if via == "autograd" and node is not None and "AccumulateGrad" in node.name():
                bucket, self.num_buckets = self.num_buckets, self.num_buckets + 1
                site, self.reduced_grads = f"DDP bucket {bucket}", self.reduced_grads or parsed.op == "all_reduce"
                self._reduced_in.add(self.backwards)
            elif node is not None:
                key = self.capture.owner_of_node(node._sequence_nr()) or ""
        if via.startswith("torch.distributed.fsdp"):
            key, record = "", None  # FSDP2's parameter management: no call's own code (reruns leave it out)
        name = str(getattr(parsed.group, "group_name", "") or "")
        seq = self._per_group.get(name, 0)
        self._per_group[name] = seq + 1
        recomputed = backward and self.capture.recomputing()
        attrs = {"op": parsed.op, "kernel": parsed.kernel, "reduce_op": parsed.reduce_op, "group": name,
                 "group_ranks": _ranks(parsed.group), "group_seq": seq, "root": parsed.root, "phase": phase,
                 "call": key, "site": site, "via": via, "bucket": bucket, "recomputed": recomputed,
                 "seq": self.capture.next_seq(), "in_splits": parsed.in_splits, "out_splits": parsed.out_splits}
        self.sink.writer.attrs(collective_group(index), attrs)
        self.recorded.append(RecordedCollective(index, parsed.op, phase, key, recomputed,
                                                tuple(tuple(t.shape) for t in parsed.inputs),
                                                tuple(tuple(t.shape) for t in outputs)))
        if self.on_output is not None and not recomputed:
            self.on_output(record, phase, {collective_path(index, f"output.{i}"): t for i, t in enumerate(outputs)})

    def _post(self, func, args: tuple, kwargs: dict, parsed: Parsed, index: int, site: str, via: str):
        """A point-to-point op: its phase and call as a collective's, posted by `P2PRecorder`."""
        backward = in_backward()  # outside autograd and every call: a pipeline's exchange, classified by p2p.py
        phase = BACKWARD if backward else FORWARD
        key, record = ("", None) if backward else self.capture.owner()
        node = torch._C._current_autograd_node() if backward else None
        if node is not None:
            key = self.capture.owner_of_node(node._sequence_nr()) or ""
        where = {"phase": phase, "call": key, "record": record, "site": site, "via": via,
                 "ranks": _ranks(parsed.group), "seq": self.capture.next_seq()}
        self.recorded.append(RecordedCollective(index, parsed.op, phase, key, False,
                                                tuple(tuple(t.shape) for t in parsed.inputs),
                                                tuple(tuple(t.shape) for t in parsed.outputs)))
        return self.p2p.post(func, args, kwargs, parsed, index, where)

    def reduced_only_last(self, backwards: int) -> bool:
        """Whether every gradient reduction ran in the last of the block's `backwards` backwards."""
        return self._reduced_in <= {backwards - 1}

    def settle(self) -> None:
        """The block ends well: every point-to-point op completed and described, before the file closes."""
        self.p2p.finish(self.sink.writer, failed=False)

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        self.p2p.finish(self.sink.writer, failed=exc_type is not None)  # nothing left to do after `settle`
        if exc_type is None and self.num_ops:
            self.sink.writer.attrs(COLLECTIVES, {"num_ops": self.num_ops})
        return result


# -- forcing in reruns ----------------------------------------------------------------------------------------------
class CollectiveForcer(IterationMode):
    """Inside a rerun: every collective returns the source's recorded outputs of the next one the call ran in this
    phase (`queues`: phase -> RecordedCollective list), cast to the rerun's dtype and device and passed through
    `adjust` (a Monte Carlo sample's perturbation); nothing communicates (module docstring)."""

    def __init__(self, source, queues: dict[str, list[RecordedCollective]], adjust: Callable, skip: type):
        super().__init__()
        self.source, self.adjust, self.skip = source, adjust, skip
        self.queues = {phase: list(items) for phase, items in queues.items()}
        self.num_forced = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_higher_order(func) or compiling():  # compiled code's operators, a compiler's own ops (`dispatch.py`)
            return self.pass_on(func, args, kwargs)
        packet = func.overloadpacket.__name__
        if func.namespace in _FUNCTIONAL and packet == "wait_tensor":
            return args[0]  # what a rerun waits for is a forced output: ready
        try:
            parsed = parse(func, args, kwargs)
        except OneIterError as err:
            raise self.skip(f"the rerun would run {func} on this rank alone ({err})") from None
        if parsed is None:
            return NotImplemented if _subclassed(types) else func(*args, **kwargs)
        if parsed.op == "barrier":
            return _done_work([]) if parsed.returns else None
        recorded = self._next(parsed)
        values = [self._value(recorded, i, like) for i, like in enumerate(self._likes(parsed, recorded))]
        self.num_forced += 1
        if parsed.functional:
            return values if func._schema.returns[0].type.kind() == "ListType" else values[0]
        with torch.no_grad():
            for out, value in zip(parsed.outputs, values, strict=True):
                out.copy_(value)
        work = _done_work(parsed.outputs)
        return (parsed.returned, work) if parsed.returns == 2 else (work if parsed.returns else None)

    def _next(self, parsed: Parsed) -> RecordedCollective:
        phase = BACKWARD if in_backward() else FORWARD
        queue = self.queues.get(phase, [])
        shapes = tuple(tuple(t.shape) for t in parsed.inputs)
        for position, item in enumerate(queue):
            if item.op == parsed.op and item.inputs == shapes:
                del queue[: position + 1]
                return item
        what = f"{parsed.op} of {[list(s) for s in shapes]} in {phase}"
        raise self.skip(f"the rerun ran a collective ({what}) the source did not record for this call")

    def _likes(self, parsed: Parsed, recorded: RecordedCollective) -> list:
        """Per recorded output, the tensor whose dtype and device its forced value takes."""
        if not parsed.functional:
            if len(parsed.outputs) != len(recorded.outputs) or any(
                    tuple(o.shape) != s for o, s in zip(parsed.outputs, recorded.outputs, strict=True)):
                raise self.skip(f"the rerun's {parsed.op} writes other shapes than the recorded one")
            return parsed.outputs
        first = parsed.inputs[0]
        return [first if i >= len(parsed.inputs) else parsed.inputs[i] for i in range(len(recorded.outputs))]

    def _value(self, recorded: RecordedCollective, i: int, like):
        path = recorded.output_path(i)
        if not self.source.has(path):
            raise self.skip(f"collective {recorded.index} ({recorded.op}) has no recorded output {i}")
        stored = self.source.tensor(path)
        if stored.is_floating_point() or stored.is_complex():
            return self.adjust(stored.to(like.device, like.dtype, copy=True))
        return stored.to(like.device, copy=True)
