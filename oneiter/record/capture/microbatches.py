"""The microbatches of one iteration (gradient accumulation): which one runs, which one a backward belongs to, and
each one's loss.

Where it sits: the Recorder (`record/recorder.py`) keeps one `Microbatches` per block. A microbatch begins at each
`rec.inputs(...)`, or at the model's outermost call after a backward returned (docs/format.md "Microbatches");
`begin` numbers it and notes the autograd node number it starts at. A backward belongs to the microbatch whose
forward created the tensor it runs on (`of_tensor`: the last microbatch that began at or before that tensor's node),
so a schedule that runs the forward of microbatch 2 before the backward of microbatch 1 (1F1B) attributes each loss
to its own microbatch, as a loop that alternates them does.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from oneiter.errors import OneIterError
from oneiter.record.capture.batch import BatchSwap, map_call, read_batch, store_batch
from oneiter.runtime.sharding import shard_of

__all__ = ["Microbatches", "reference_swaps", "refuse_accumulated"]


def reference_swaps(ref) -> list[BatchSwap]:
    """The swaps that hand out a reference iteration's batch, one per microbatch (`IterationFile`, or a step's)."""
    count = ref.microbatches()
    return [BatchSwap(read_batch(ref, m), ref.path.name, m if count > 1 else None) for m in range(count)]


def refuse_accumulated(model, accumulation: int = 1) -> None:
    """Refuse, in one line, a block whose parameters hold gradients when its first backward runs: accumulated by
    microbatches run before the block (gradient accumulation), whose batch it does not hold; a replay of it starts
    its gradients from the target's own earlier microbatch and diverges. `accumulation`: what the optimizer's wrapper
    says it accumulates over (1: nothing)."""
    import torch

    held = next((n for n, p in model.named_parameters()
                 if p.grad is not None and bool(torch.any(shard_of(p.grad).detach() != 0))), None)
    if held is None:
        return
    over = f" (its optimizer accumulates over {accumulation} microbatches)" if accumulation > 1 else ""
    raise OneIterError(f"the parameters already hold gradients when this block's first backward runs ({held}): they "
                       f"were accumulated by microbatches run before the Recorder block{over}; a recording holds the "
                       f"whole accumulation window: open the Recorder before the window's first microbatch (the "
                       f"iteration right after the previous optimizer step) and close it after the step",
                       param="model")


class Microbatches:
    """The microbatches begun so far in one Recorder block, and the loss of each."""

    def __init__(self) -> None:
        self.count = 0  # how many began
        self.starts: list[int] = []  # the autograd node number each began at (-1: unknown)
        self.losses: dict[int, Any] = {}  # microbatch -> the (detached) tensor its first backward ran on
        self.explicit: set[int] = set()  # microbatches whose loss `rec.loss` named
        self.batch_tensors = 0  # batch tensors stored so far: the next one is `batch/input.<batch_tensors>`
        self.from_inputs = False  # `rec.inputs` began the current one and the model has not been called since
        self.backwards: set[int] = set()  # microbatches a backward ran in (from a loss, or from given gradients)
        self.scheduled = -1  # a pipeline schedule's backward of this microbatch runs now (-1: none says)

    @property
    def current(self) -> int:
        """The microbatch whose forward runs (the last one begun); 0 before any began."""
        return max(self.count - 1, 0)

    def begin(self, node: int) -> int:
        """A new microbatch begins at autograd node number `node`; its number."""
        self.starts.append(node)
        self.count += 1
        return self.count - 1

    def of_tensor(self, tensor) -> int:
        """The microbatch whose forward created `tensor` (the one a backward on it belongs to): the one a pipeline
        schedule says it runs the backward of (`scheduled`), else by the tensor's autograd node's number; the current
        one when torch cannot say (no grad_fn, no sequence number)."""
        if self.scheduled >= 0:
            return self.scheduled
        node = getattr(tensor, "grad_fn", None)
        number = node._sequence_nr() if node is not None and hasattr(node, "_sequence_nr") else -1
        if number < 0 or any(s < 0 for s in self.starts):
            return self.current
        return max(bisect.bisect_right(self.starts, number) - 1, 0)

    def note_loss(self, microbatch: int, tensor, *, explicit: bool = False) -> None:
        """`tensor` is microbatch `microbatch`'s loss: the first one a backward ran on, unless `rec.loss` named one."""
        if explicit:
            self.losses[microbatch] = tensor
            self.explicit.add(microbatch)
        elif microbatch not in self.losses:
            self.losses[microbatch] = tensor

    def take(self, sink, args: tuple, kwargs: dict, swaps: list[BatchSwap] | None, source: str):
        """The batch of the microbatch that just began: on replay the reference's microbatch's in its place (`swaps`,
        of the reference `source`), then stored (`batch/input.<n>` numbered on, with its microbatch)."""
        micro = self.current
        if swaps is not None:
            if micro >= len(swaps):
                raise OneIterError(f"this replay began microbatch {micro} of its iteration, but the reference "
                                   f"'{source}' ran {len(swaps)} before its step: run as many microbatches (gradient "
                                   f"accumulation steps) as the reference", param="replay")
            args, kwargs = map_call(args, kwargs, swaps[micro])
            swaps[micro].check_complete()
        self.batch_tensors += store_batch(sink, args, kwargs, start=self.batch_tensors, microbatch=micro)
        return args, kwargs

    def check_replayed(self, swaps: list[BatchSwap] | None, source: str) -> None:
        """A replay ran as many microbatches as its reference `source` (fewer would compare part of an iteration)."""
        if swaps is not None and self.count < len(swaps):
            raise OneIterError(f"this replay ran {self.count} microbatch{'es' if self.count != 1 else ''} before its "
                               f"step, but the reference '{source}' ran {len(swaps)}: run as many microbatches "
                               f"(gradient accumulation steps) as the reference", param="replay")

    def has_loss(self) -> bool:
        return bool(self.losses)

    def has_backward(self) -> bool:
        """Whether a backward ran: from a loss, or from gradients handed to it (a pipeline stage before the last,
        whose backward starts from the gradients the next stage sent: it has no loss of its own)."""
        return bool(self.losses or self.backwards)

    def values(self, unscale) -> list:
        """Each microbatch's loss (its tensor, `unscale`d unless `rec.loss` named it); None where none is known."""
        return [None if m not in self.losses else
                (self.losses[m] if m in self.explicit else unscale(self.losses[m])) for m in range(self.count)]

    @staticmethod
    def total(values: list):
        """The iteration's loss: the one microbatch's as it is, or the sum of several (what the accumulated
        gradients are the gradient of), in the dtype of the first."""
        known = [v for v in values if v is not None]
        import torch

        if not known:  # a pipeline stage before the last: no loss of its own
            return torch.tensor(math.nan, dtype=torch.float32)
        if len(values) == 1 or len(known) == 1:
            return known[0]

        return torch.stack([v.detach().reshape(()).to(known[0].dtype) for v in known]).sum()

    @staticmethod
    def as_floats(values: list) -> list[float]:
        """The losses as float64 numbers, NaN for a microbatch no backward ran in (`/microbatch_loss`)."""
        return [math.nan if v is None else float(v.detach().double().reshape(())) for v in values]
