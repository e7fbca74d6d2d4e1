"""The torch modes active while a Recorder's iteration runs its forward and backward, entered and left as one.

Where this sits: `oneiter.Recorder` (`record/recorder.py`) holds one `ActiveModes` for its block: random values
recorded (a reference) or replayed (a replay, `randomness.py`), the op fallback (`fallback.py`), and with a process
group the collectives' recorder (`collectives.py`) and the pipeline schedule's watch (`pipeline.py`). They are left
while a backward's gradients are kept (`pause`), entered again for the next microbatch (`resume`), and closed before
the optimizer's step (`close`). The modes themselves load torch: they are imported when a block starts.
"""

from __future__ import annotations

import json
import weakref
from contextlib import ExitStack

from oneiter.format.schema import ROOT_MODULE
from oneiter.record.modes.pipeline import PipelineWatch

__all__ = ["ActiveModes", "open_block"]


class ActiveModes:
    """The torch modes active during forward and backward: random record/replay, op fallback, and (with a process
    group) the collectives' recorder (`record/modes/collectives.py`)."""

    def __init__(self, sink, ref, device, random_replay: bool, fallback: list[str], capture=None, on_output=None,
                 on_chunk=None, on_scaled=None):
        from oneiter.record.modes.collectives import CollectiveRecorder, is_distributed
        from oneiter.record.modes.fallback import OpFallback
        from oneiter.record.modes.randomness import RandomRecorder, RandomReplayer

        held = weakref.ref(capture) if capture is not None else lambda: None  # the capture counts this mode's ops:
        inside = lambda: open_block(held())  # noqa: E731 - no cycle between them, which would outlive the block
        self.random: RandomRecorder | RandomReplayer
        if ref is None:
            self.random = RandomRecorder(sink, inside=inside)
        else:  # without random replay: still count the random ops (each call notes which ones it ran)
            self.random = RandomReplayer(ref, device, replay=random_replay, inside=inside)
        self.fallback = OpFallback(fallback) if fallback else None
        self.pipeline = PipelineWatch(on_chunk, getattr(capture, "suspended", None), on_scaled) \
            if is_distributed() else None
        self.collectives = CollectiveRecorder(sink, capture, on_output, self.pipeline.tagged) \
            if self.pipeline is not None else None
        self._stack, self._until_end = ExitStack(), ExitStack()

    def __enter__(self) -> "ActiveModes":
        if self.collectives is not None:  # first: dispatch modes leave in the reverse order they came
            assert self.pipeline is not None  # made with the collectives' recorder
            self._until_end.enter_context(self.pipeline)
            self._until_end.enter_context(self.collectives)
        for mode in (self.random, self.fallback):
            if mode is not None:
                self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc) -> None:
        self.close(check=exc[0] is None)
        self._until_end.__exit__(*exc)  # after an error, a transfer nobody waited for is not waited for

    def close(self, check: bool = True) -> None:
        """End the modes (before the optimizer step: its math is not part of what they judge); the collectives are
        recorded until the block ends, the step's as its own phase (a tensor-parallel step reduces gradients).
        `check`: a replay replayed every random op of its reference."""
        paused, self._paused = self._paused, False
        self._stack.close()
        if paused and check and hasattr(self.random, "check_complete"):
            self.random.check_complete()  # left paused: its exit did not check
        if self.collectives is not None:
            self.collectives.stepping = True

    _paused = False

    def pause(self) -> None:
        """A backward returned: the random and fallback modes are left until the next microbatch's forward (or a
        further backward): what runs now (clipping) is no part of what they judge, and inside a Python dispatch mode
        torch's foreach in-place ops (clip_grad_norm_'s) do not move the version counters the Recorder reads. The
        collectives count as the step's until then."""
        self._backwards += 1
        if self.collectives is not None:
            self.collectives.backwards = self._backwards
        if self._paused:
            return
        self._paused = True
        self.random.pausing = True
        try:
            self._stack.close()
        finally:
            self.random.pausing = False
        if self.collectives is not None:
            self.collectives.stepping = True

    def resume(self) -> None:
        """A microbatch's forward (or a further backward) runs: the modes are entered again."""
        if not self._paused:
            return
        self._paused = False
        for mode in (self.random, self.fallback):
            if mode is not None:
                self._stack.enter_context(mode)
        if self.collectives is not None:
            self.collectives.stepping = False

    def backward_from(self, grads: list, microbatch: int) -> None:
        """A backward of `microbatch` runs from these gradients: a point-to-point op that received one moved a
        gradient."""
        if self.collectives is not None:
            self.collectives.p2p.backward_from(grads, microbatch)

    def reduced_grads(self) -> bool:
        """Whether a reducer (DDP's) averaged the parameter gradients over ranks in backward."""
        return self.collectives is not None and self.collectives.reduced_grads

    def own_grads_kept(self) -> bool:
        """Whether the gradients kept before the reducer averaged them are this rank's own sums: a reducer ran, in
        the last backward only. A pipeline schedule over DDP (`torch.distributed.pipelining`) lets DDP reduce in an
        earlier microbatch's backward too; the next backward then adds to averaged gradients, and no rank's own sum
        is ever held: nothing is stored as one (`param_grads_unreduced`), and the parameter rows go unjudged."""
        return self.collectives is not None and self.reduced_grads() \
            and self.collectives.reduced_only_last(self._backwards)

    _backwards = 0  # backwards returned so far

    def summary(self) -> dict:
        """The modes' root attributes; the point-to-point ops completed and described first (the file closes next)."""
        if self.collectives is not None:
            self.collectives.settle()
        return {
            "num_random_ops": self.random.num_ops,
            "fallback_counts": json.dumps(self.fallback.counts if self.fallback is not None else {}),
        }


def open_block(capture) -> str:
    """The compiled block whose call is open now, in words ("the compiled block layers.0 (inductor)"), or ""."""
    path = capture.open_block() if capture is not None else None
    if path is None:
        return ""
    return f"the compiled block {path or ROOT_MODULE} ({capture.blocks.by_path[path].backend})"
