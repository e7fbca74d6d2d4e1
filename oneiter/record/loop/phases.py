"""Where a Recorder's iteration is: one `Phase`, and the moves between phases (`MOVES`).

Where this sits: `flow.py` moves the phase as the iteration's events arrive (the model's call, a backward, the
optimizer's step); `oneiter.Recorder.phase` reads it. The order of an iteration is written down here alone.
"""

from __future__ import annotations

import enum

from oneiter.errors import OneIterError

__all__ = ["Phase", "MOVES", "never_called"]


class Phase(enum.IntEnum):
    """Where the recorded iteration is, along `MOVES`: forward, backward and gradients once per microbatch (a
    further microbatch goes back to FORWARD), then the step; what an event does depends on it alone (a later
    forward or a second step after the step find the phase past theirs and do nothing)."""

    IDLE = 0  # constructed, the block not entered
    OPEN = 1  # inside the block: hooks attached, no batch yet
    FORWARD = 2  # a microbatch's batch is taken (rec.inputs, or the model's call): its forward runs
    BACKWARD = 3  # a backward runs: autocast ended, its microbatch's loss is known
    GRADS = 4  # the backward returned: gradients as accumulated so far kept, random/fallback modes paused
    STEPPED = 5  # the optimizer's first step began: gradients stored, deferred probes run, its update judged
    CLOSED = 6  # the block ended


# each phase, and the phases it may be entered from (the only place the order of an iteration is written down);
# once the gradients are stored (`IterationFlow.settle_grads`: the step began, or the block ends) no microbatch follows
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.OPEN: frozenset({Phase.IDLE}),
    Phase.FORWARD: frozenset({Phase.OPEN, Phase.FORWARD, Phase.GRADS}),  # the next microbatch
    Phase.BACKWARD: frozenset({Phase.FORWARD, Phase.GRADS}),  # GRADS: a second backward of a microbatch
    Phase.GRADS: frozenset({Phase.FORWARD, Phase.BACKWARD}),  # no backward seen: read at the step or the end
    Phase.STEPPED: frozenset({Phase.GRADS}),
    Phase.CLOSED: frozenset(Phase) - {Phase.CLOSED},
}


def never_called() -> OneIterError:
    return OneIterError("the model was never called inside the Recorder block, so there is no batch to record: "
                        "give the Recorder the module your training code calls, or hand the batch to "
                        "rec.inputs(...)", param="model")
