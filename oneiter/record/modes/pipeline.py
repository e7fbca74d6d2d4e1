"""torch.distributed.pipelining's stages, as a Recorder block sees them: which microbatch each stage call runs, and
which microbatch's activations or gradients each point-to-point op moves.

Where this sits: the Recorder enters a `PipelineWatch` with its modes when `torch.distributed.pipelining` is loaded.
A schedule (`ScheduleGPipe`, `Schedule1F1B`, the interleaved ones) runs each stage's microbatch `i` through
`forward_one_chunk(i, ...)` and `backward_one_chunk(i, ...)`, and builds the ops that move its tensors between
stages with `get_fwd_recv_ops(i)`, `get_fwd_send_ops(i)`, `get_bwd_recv_ops(i)`, `get_bwd_send_ops(i)`, posting them
later (`_batch_p2p`, outside any of these). While the block runs those methods are wrapped: the forward and
backward of chunk `i` tell `on_chunk(phase, i)` (the Recorder numbers the stage's calls by the schedule's
microbatch), and every tensor an op is built for is tagged with (phase, microbatch), which `p2p.py` reads when the
op is posted. The schedule's first step infers the shapes its stages exchange by running each stage's module on
stand-in tensors (`_prepare_forward_infra`, `_prepare_backward_infra`): that runs `quiet()` (no call is captured;
the tensors it exchanges are still recorded, as every transfer is). A stage's `scale_grads` (the gradients divided by
the number of microbatches) waits until the schedule's `step` returns (`_scale_wrapper`), and `on_scaled(params,
factor)` says which gradients it divided by what (the optimizer's update is judged from gradients divided alike).
A schedule that splits
each backward in two (zero bubble) is refused when its step begins, before anything communicates, on every rank.
Nothing else of the schedule changes; the wrappers go when the block ends.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from oneiter.errors import OneIterError
from oneiter.format.schema import BACKWARD, FORWARD

__all__ = ["PipelineWatch"]

_OPS = {"get_fwd_recv_ops": FORWARD, "get_fwd_send_ops": FORWARD, "get_bwd_recv_ops": BACKWARD,
        "get_bwd_send_ops": BACKWARD}
_CHUNKS = {"forward_one_chunk": FORWARD, "backward_one_chunk": BACKWARD}
# the schedule's first step infers the shapes its stages exchange by running each stage's module on stand-in tensors
# (uninitialised ones on a stage that receives): no part of the iteration, so nothing of them is recorded
_SETUP = ("_prepare_forward_infra", "_prepare_backward_infra")


def _with_subclasses(cls) -> list[type]:
    found, stack = [], [cls]
    while stack:
        klass = stack.pop()
        if klass not in found:
            found.append(klass)
            stack.extend(klass.__subclasses__())
    return found


def _check_schedule(schedule) -> None:
    """Refuse, before its step communicates (so on every rank at once), a schedule that splits each backward into an
    input-gradient and a weight-gradient pass (the zero-bubble ones): a recording holds one backward per microbatch."""
    order = getattr(schedule, "pipeline_order", None) or {}
    kinds = {str(getattr(getattr(action, "computation_type", None), "value", "")) for actions in order.values()
             for action in actions or () if action is not None}
    if kinds & {"I", "W"}:
        raise OneIterError(f"{type(schedule).__name__} splits each microbatch's backward into an input-gradient and "
                           f"a weight-gradient pass (zero bubble), which a recording cannot hold (one backward per "
                           f"microbatch): record the step with ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B "
                           f"(the same gradients)", param="model")


def _loaded(module: str, name: str):
    """A class of torch.distributed.pipelining, if the program loaded it (never imported here)."""
    found = sys.modules.get(f"torch.distributed.pipelining.{module}")
    return getattr(found, name, None) if found is not None else None


class PipelineWatch:
    """The wrappers of one block (module docstring). `tagged(tensor)` is (phase, microbatch) of an op built for
    `tensor`, or None; `stage` the index of the stage whose chunk runs now (-1: none)."""

    def __init__(self, on_chunk: Callable[[str, int], None] | None = None, quiet: Callable[[], Any] | None = None,
                 on_scaled: Callable[[list, float], None] | None = None):
        self.on_chunk, self.quiet, self.on_scaled = on_chunk, quiet, on_scaled
        self._tags: dict[int, tuple[Any, str, int]] = {}  # id(tensor) -> (the tensor, kept alive; phase; microbatch)
        self._saved: list[tuple[type, str, Any]] = []
        self.stage = -1
        self._stepping = 0  # schedule steps running (nested: a schedule's step calling its base's)
        self._scalings: list[tuple[Any, Any, tuple, dict]] = []  # (scale_grads, stage, args, kwargs), deferred

    def __enter__(self) -> "PipelineWatch":
        stage, schedule = _loaded("stage", "_PipelineStageBase"), _loaded("schedules", "_PipelineSchedule")
        if stage is None or schedule is None:
            return self
        for klass in _with_subclasses(stage):  # each class that defines one of them (PipelineStage overrides some)
            for name, phase in _OPS.items():
                self._wrap(klass, name, lambda f, phase=phase: self._ops_wrapper(f, phase))
            for name, phase in _CHUNKS.items():
                self._wrap(klass, name, lambda f, phase=phase: self._chunk_wrapper(f, phase))
            for name in _SETUP if self.quiet is not None else ():
                self._wrap(klass, name, self._quiet_wrapper)
            self._wrap(klass, "scale_grads", self._scale_wrapper)
        for klass in _with_subclasses(schedule):
            self._wrap(klass, "step", self._step_wrapper)
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            cls, name, original = self._saved.pop()
            setattr(cls, name, original)
        self._tags.clear()

    def tagged(self, tensor) -> tuple[str, int] | None:
        found = self._tags.pop(id(tensor), None)
        return None if found is None or found[0] is not tensor else (found[1], found[2])

    def _wrap(self, cls, name: str, make) -> None:
        """Replace `cls`'s own `name` (if it defines one) by `make(original)`."""
        original = cls.__dict__.get(name)
        if original is None:
            return
        self._saved.append((cls, name, original))
        setattr(cls, name, make(original))

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

    def _quiet_wrapper(self, original):
        quiet = self.quiet
        assert quiet is not None  # the setup is wrapped only when `quiet` is given

        def setup(stage, *args, **kwargs):
            with quiet():
                return original(stage, *args, **kwargs)

        return setup

    def _scale_wrapper(self, original):
        """A stage's gradients divided by the number of microbatches: deferred to the end of the schedule's step, as
        single-stage schedules do it. An interleaved schedule scales each stage after that stage's last backward,
        while another stage of the rank still runs its own, and the gradients a backward leaves (what the Recorder
        keeps) would be some scaled and some not; no other stage's backward reads a stage's gradients, so the result
        is the same."""
        watch = self

        def scale(stage, *args, **kwargs):
            if not watch._stepping:
                return original(stage, *args, **kwargs)
            watch._scalings.append((original, stage, args, kwargs))
            return None

        return scale

    def _step_wrapper(self, original):
        watch = self

        def step(schedule, *args, **kwargs):
            if not watch._stepping:
                _check_schedule(schedule)
            watch._stepping += 1
            try:
                result = original(schedule, *args, **kwargs)
            finally:
                watch._stepping -= 1
            while not watch._stepping and watch._scalings:
                scale, stage, s_args, s_kwargs = watch._scalings.pop(0)
                scale(stage, *s_args, **s_kwargs)
                factor = (list(s_args) + [s_kwargs.get("grad_scale_factor", 1)])[0]
                if watch.on_scaled is not None and factor != 1:
                    watch.on_scaled(list(stage.submod.parameters()), float(factor))
            return result

        return step

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
