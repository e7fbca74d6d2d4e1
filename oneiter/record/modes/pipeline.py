"""torch.distributed.pipelining's stages, as a Recorder block sees them: which microbatch each stage call runs, and
which microbatch's activations or gradients each point-to-point op moves.

Where this sits: the Recorder enters a `PipelineWatch` with its modes when `torch.distributed.pipelining` is loaded.
A schedule (`ScheduleGPipe`, `Schedule1F1B`, the interleaved ones) runs each stage's microbatch `i` through
`forward_one_chunk(i, ...)` and `backward_one_chunk(i, ...)`, and builds the ops that move its tensors between
stages with `get_fwd_recv_ops(i)`, `get_fwd_send_ops(i)`, `get_bwd_recv_ops(i)`, `get_bwd_send_ops(i)`, posting them
later (`_batch_p2p`, outside any of these). While the block runs those methods are wrapped: the forward and
backward of chunk `i` tell `on_chunk(phase, i)` (the Recorder numbers the stage's calls by the schedule's
microbatch), and every tensor an op is built for is tagged with (phase, microbatch), which `p2p.py` reads when the
op is posted. Nothing else of the schedule changes; the wrappers go when the block ends.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from oneiter.format.schema import BACKWARD, FORWARD

__all__ = ["PipelineWatch"]

_OPS = {"get_fwd_recv_ops": FORWARD, "get_fwd_send_ops": FORWARD, "get_bwd_recv_ops": BACKWARD,
        "get_bwd_send_ops": BACKWARD}
_CHUNKS = {"forward_one_chunk": FORWARD, "backward_one_chunk": BACKWARD}


def _stage_class():
    """torch.distributed.pipelining's stage base class, if the program loaded it (never imported here)."""
    module = sys.modules.get("torch.distributed.pipelining.stage")
    return getattr(module, "_PipelineStageBase", None) if module is not None else None


class PipelineWatch:
    """The wrappers of one block (module docstring). `tagged(tensor)` is (phase, microbatch) of an op built for
    `tensor`, or None; `stage` the index of the stage whose chunk runs now (-1: none)."""

    def __init__(self, on_chunk: Callable[[str, int], None] | None = None):
        self.on_chunk = on_chunk
        self._tags: dict[int, tuple[Any, str, int]] = {}  # id(tensor) -> (the tensor, kept alive; phase; microbatch)
        self._saved: list[tuple[type, str, Any]] = []
        self.stage = -1

    def __enter__(self) -> "PipelineWatch":
        cls = _stage_class()
        if cls is None:
            return self
        for name, phase in _OPS.items():
            self._wrap(cls, name, self._ops_wrapper(getattr(cls, name), phase))
        for name, phase in _CHUNKS.items():
            self._wrap(cls, name, self._chunk_wrapper(getattr(cls, name), phase))
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            cls, name, original = self._saved.pop()
            setattr(cls, name, original)
        self._tags.clear()

    def tagged(self, tensor) -> tuple[str, int] | None:
        found = self._tags.pop(id(tensor), None)
        return None if found is None or found[0] is not tensor else (found[1], found[2])

    def _wrap(self, cls, name: str, wrapper) -> None:
        self._saved.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, wrapper)

    def _ops_wrapper(self, original, phase: str):
        watch = self

        def ops(stage, chunk_id: int, *args, **kwargs):
            built = original(stage, chunk_id, *args, **kwargs)
            for op in built:
                tensor = getattr(op, "tensor", None)
                if tensor is not None:
                    watch._tags[id(tensor)] = (tensor, phase, int(chunk_id))
            return built

        return ops

    def _chunk_wrapper(self, original, phase: str):
        watch = self

        def chunk(stage, chunk_id: int, *args, **kwargs):
            if watch.on_chunk is not None:
                watch.on_chunk(phase, int(chunk_id))
            before, watch.stage = watch.stage, int(getattr(stage, "stage_index", -1))
            try:
                return original(stage, chunk_id, *args, **kwargs)
            finally:
                watch.stage = before

        return chunk
