"""Point-to-point ops (`send`, `recv`, `isend`/`irecv`, `batch_isend_irecv`): recorded per rank like collectives,
completed when the caller waits for them, never waited twice.

Where this sits: `collectives.py`'s `CollectiveRecorder` sees every c10d op; a `send` or `recv_` it hands to the
`P2PRecorder` here. A collective is issued by every rank of its group in one order, so the recorder may wait for it
as it records it; a point-to-point op is not: a pipeline posts a receive and a send together and waits for both
later (`batch_isend_irecv`, torch.distributed.pipelining's schedules, Megatron's `_communicate`), and waiting for
the receive before the send is posted deadlocks the two ranks. Nor can its Work be waited for twice: gloo's
send/recv Work waits for a *new* completion on the second `wait()` (forever) — why a Recorder block around a
pipeline schedule's `step` hung both ranks. So each op is posted as the caller posted it, and the caller gets a
`Transfer` (a `Work`) in its place, whose `wait()` waits for the real one once (with oneiter's timeout,
`runtime/distributed.dist_timeout`) and records what it moved: a send's tensor when it is posted (the caller may
not change it until the op completes), a receive's when it completes. An op nobody waited for is waited for when
the block ends.

Each op is one entry of `/collectives/<index>` (the collectives' numbering, their attributes: op `send` or `recv`,
group, phase, call, site, via), plus `peer` (the other rank, global), `tag`, `p2p_seq` (how many ops of this
direction this rank ran with that peer, on that group and tag, before: the n-th send from rank 0 to rank 1 is the
n-th receive of rank 1 from rank 0, whatever else either rank did) and `microbatch`. Its tensor is `input.0` (send)
or `output.0` (recv). `judge/iteration/transfers.py` pairs each send with its receive across the ranks' files.

Phase and microbatch: an op posted inside a call's own code is that call's (forward, or backward inside autograd);
an op posted between calls (a pipeline's exchange between stages) takes what `pipeline.py` knows of it
(torch.distributed.pipelining: which microbatch's activations or gradients it moves), else what the data says: a
receive whose tensor a backward then runs from (`grad_tensors`) is in that backward's phase and microbatch, any
other receive in the microbatch of the next call that begins (the stage call it feeds), a send of the gradient of a
tensor an earlier receive filled is in backward, in that receive's microbatch; any other send in the microbatch
running when it was posted (`microbatch()`: the forward that made what it sends).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from oneiter.errors import OneIterError
from oneiter.format.schema import BACKWARD, FORWARD, P2P_OPS, collective_group, collective_path
from oneiter.runtime.distributed import dist_timeout

__all__ = ["P2P_OPS", "Transfer", "P2PRecorder", "transfer_name"]



def transfer_name(op: str, peer: int, tag: int) -> str:
    """`send to rank 1` / `recv from rank 0` (`, tag 3` when a tag is set)."""
    way = "to" if op == "send" else "from"
    return f"{op} {way} rank {peer}" + (f", tag {tag}" if tag else "")


@dataclass
class _Op:
    """One point-to-point op of the block, until its attributes are written (`P2PRecorder.finish`)."""

    index: int
    op: str
    kernel: str
    group: Any
    group_name: str
    group_ranks: list
    peer: int  # global; -1 until a receive from any source completed
    tag: int
    phase: str
    call: str
    site: str
    via: str
    microbatch: int
    seq: int
    tensors: list  # the send's tensors (stored when posted) or the receive's buffers (stored when completed)
    record: Any = None  # the CallRecord whose own code posted it (the probe's fidelity check), or None
    p2p_seq: int = -1
    completed: bool = False
    known: bool = False  # phase and microbatch were given by what posted it (pipeline.py), not guessed


class Transfer(dist.Work):
    """The Work a caller gets for a recorded point-to-point op: `wait()` completes the real one once (and records
    it); any later `wait()` returns at once."""

    def __init__(self, recorder: "P2PRecorder", op: _Op, work):
        super().__init__()
        self._recorder, self._op, self._work = recorder, op, work

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._recorder.complete(self._op, self._work, timeout)
        return True

    def is_completed(self) -> bool:
        return self._op.completed

    def is_success(self) -> bool:
        return self._op.completed

    def exception(self):
        return None

    def _source_rank(self) -> int:
        self.wait()
        return self._op.peer if self._op.peer < 0 else _group_rank(self._op.group, self._op.peer)

    def source_rank(self) -> int:
        return self._source_rank()

    def result(self) -> list:
        self.wait()
        return list(self._op.tensors)

    def synchronize(self) -> None:
        self.wait()

    def get_future(self):
        """A future already holding the op's tensors, once it completed (waited for here)."""
        self.wait()
        future: torch.futures.Future[list] = torch.futures.Future()
        future.set_result(list(self._op.tensors))
        return future


def _bind(func, args: tuple, kwargs: dict) -> dict:
    bound = dict(zip((a.name for a in func._schema.arguments), args, strict=False))
    bound.update(kwargs)
    return bound


def _global_rank(group, group_rank: int) -> int:
    try:
        return int(dist.get_global_rank(group, group_rank))
    except Exception:  # noqa: BLE001 - the default group: its ranks are the global ones
        return group_rank


def _group_rank(group, global_rank: int) -> int:
    try:
        return int(dist.get_group_rank(group, global_rank))
    except Exception:  # noqa: BLE001 - the default group: its ranks are the global ones
        return global_rank


class P2PRecorder:
    """The point-to-point ops of one block (module docstring). `post` is called by the collective recorder's
    dispatch; `finish` when the block ends.

    `sink` stores the tensors (`TensorSink`); `microbatch()` is the microbatch running now; `tagged(tensor)` what
    pipeline.py knows of an op moving `tensor`: (phase, microbatch) or None; `on_output(record, phase, outputs)`
    hands a receive's live value to the probe when a call's own code ran it."""

    def __init__(self, sink, microbatch: Callable[[], int], tagged: Callable[[Any], Any] | None = None,
                 on_output: Callable | None = None):
        self.sink, self.microbatch, self.tagged, self.on_output = sink, microbatch, tagged, on_output
        self.ops: list[_Op] = []
        self._unclaimed: list[_Op] = []  # receives between calls whose microbatch the next call's forward says
        self._pending: list[Transfer] = []  # kept alive: C++ holds them by pointer only
        self._counts: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def post(self, func, args: tuple, kwargs: dict, parsed, index: int, where: dict) -> Any:
        """Post the op `func` (`parsed`: what the collective recorder read of it) as the caller asked and return a
        `Transfer` for it. `where`: the phase, call, its record, site and via the collective recorder found, the
        group's global ranks and the capture's `seq`."""
        bound = _bind(func, args, kwargs)
        peer_arg = bound.get("dst", bound.get("src"))
        peer = _global_rank(parsed.group, int(peer_arg)) if peer_arg is not None else -1
        tensors = parsed.inputs if parsed.op == "send" else parsed.outputs
        op = _Op(index, parsed.op, parsed.kernel, parsed.group, str(getattr(parsed.group, "group_name", "") or ""),
                 where["ranks"], peer, int(bound.get("tag", 0) or 0), where["phase"], where["call"],
                 where["site"], where["via"], self.microbatch(), where["seq"], list(tensors), where["record"])
        self._classify(op)
        if op.op == "send":  # the caller may not change it until the op completes: its value now is what is sent
            for i, tensor in enumerate(tensors):
                self.sink.put(collective_group(index), f"input.{i}", tensor)
        try:
            work = func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the backend's, on the model's own arguments
            raise _transfer_failed(op, exc) from exc
        with self._lock:
            self.ops.append(op)
        transfer = Transfer(self, op, _unboxed(work))
        self._pending.append(transfer)
        return transfer.boxed()

    def complete(self, op: _Op, work, timeout: timedelta | None) -> None:
        """Wait for the real op once, within oneiter's timeout, and record what it received."""
        if op.completed:
            return
        limit = timedelta(seconds=dist_timeout())
        try:
            work.wait(min(timeout, limit) if timeout else limit)
        except Exception as exc:  # noqa: BLE001 - a peer that stopped, a timeout: one line, on this rank
            op.completed = True
            raise _transfer_failed(op, exc) from exc
        op.completed = True
        if op.peer < 0:
            op.peer = _global_rank(op.group, int(work._source_rank()))
        if op.op == "recv":
            for i, tensor in enumerate(op.tensors):
                self.sink.put(collective_group(op.index), f"output.{i}", tensor, dedup=False)
            if self.on_output is not None and op.record is not None:
                self.on_output(op.record, op.phase, {collective_path(op.index, f"output.{i}"): t
                                                     for i, t in enumerate(op.tensors)})

    def claim(self, microbatch: int) -> None:
        """A call's forward begins, in `microbatch`: the receives posted between calls since are its input (a
        pipeline stage receives its microbatch's activations, then runs them)."""
        for op in self._unclaimed:
            if op.phase == FORWARD:
                op.microbatch = microbatch
        self._unclaimed.clear()

    def backward_from(self, grads, microbatch: int) -> None:
        """A backward of `microbatch` runs from `grads` (`torch.autograd.backward`'s `grad_tensors`): a receive
        that filled one of them moved the gradient of this rank's output (phase backward), whatever posted it."""
        ptrs = {_ptr(g) for g in grads if isinstance(g, torch.Tensor)}
        for op in self.ops:
            if op.op == "recv" and not op.known and not op.call and any(_ptr(t) in ptrs for t in op.tensors):
                op.phase, op.microbatch = BACKWARD, microbatch

    def finish(self, writer, failed: bool) -> None:
        """The block ends: wait for ops nobody waited for (not after an error), number them per channel, write
        their attributes."""
        for transfer in list(self._pending):
            if not failed:
                transfer.wait()
        self._pending.clear()
        if failed or self._counts:
            return
        for op in self.ops:
            channel = (op.group_name, op.op, op.peer, op.tag)
            op.p2p_seq = self._counts.get(channel, 0)
            self._counts[channel] = op.p2p_seq + 1
            writer.attrs(collective_group(op.index), self.attrs(op))

    def attrs(self, op: _Op) -> dict:
        return {"op": op.op, "kernel": op.kernel, "reduce_op": "", "group": op.group_name,
                "group_ranks": op.group_ranks, "group_seq": -1, "root": -1, "phase": op.phase, "call": op.call,
                "site": op.site, "via": op.via, "bucket": -1, "recomputed": False, "seq": op.seq,
                "in_splits": [], "out_splits": [], "peer": op.peer, "tag": op.tag, "p2p_seq": op.p2p_seq,
                "microbatch": op.microbatch}

    def _classify(self, op: _Op) -> None:
        """Phase and microbatch of an op posted between calls (module docstring)."""
        if op.call or op.phase != FORWARD:
            return
        known = self.tagged(op.tensors[0]) if self.tagged is not None and op.tensors else None
        if known is not None:
            op.phase, op.microbatch = known
            op.known = True
            return
        if op.op == "recv":
            self._unclaimed.append(op)
            return
        if op.op == "send":  # the gradient of what an earlier receive filled: it goes back
            for earlier in self.ops:
                if earlier.op == "recv" and earlier.phase == FORWARD and any(
                        _is_grad_of(op.tensors[0], t) for t in earlier.tensors):
                    op.phase, op.microbatch = BACKWARD, earlier.microbatch
                    return


def _ptr(tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage
        return -1


def _is_grad_of(sent, buffer) -> bool:
    """Whether `sent` is the gradient autograd left in `buffer` (the leaf a receive filled), or a view of it."""
    grad = getattr(buffer, "grad", None)
    return grad is not None and (grad is sent or _ptr(grad) == _ptr(sent))


def _unboxed(work):
    if isinstance(work, torch.ScriptObject):
        from torch.distributed.distributed_c10d import Work

        return Work.unbox(work)
    return work


def _transfer_failed(op: _Op, exc: Exception) -> OneIterError:
    text = " ".join(str(exc).split())[:300]
    where = f" at {op.site}" if op.site else ""
    return OneIterError(f"{transfer_name(op.op, op.peer, op.tag)}{where} failed on this rank: {type(exc).__name__}: "
                        f"{text} (when another rank stopped first, its error says why)")

