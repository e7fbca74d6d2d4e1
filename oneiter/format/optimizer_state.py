"""Whether a replay's optimizer started from the reference's state: the one rule that decides whether its
parameter updates can be judged.

Sits in the format layer because both sides read it from the files: the recorder writes the root attribute
`optimizer_state` (what the optimizer held when the recorded step began), the teacher-forced probe asks
`updates_not_judged` before it steps a copy of the optimizer (`record/probe.py`), and the engine asks it again
before it judges the updated weights (`judge/engine.py`). Values of the attribute:

- `empty`: the optimizer held nothing (a stateless one such as plain SGD, or any optimizer before its first step);
- `not recorded`: it held state from earlier steps (SGD's momentum, Adam's moments) that the file does not hold;
- "" or absent: no optimizer, or a file written before the attribute existed (judged as before).

An update can equal the reference's only when both optimizers started from the same state; today that is known
only when both were empty. When recordings hold the optimizer's state and a replay loads it, the value saying so
joins `SAME_START` and nothing else changes.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["OPTIMIZER_STATE", "EMPTY", "NOT_RECORDED", "SAME_START", "state_of", "updates_not_judged"]

OPTIMIZER_STATE = "optimizer_state"  # the root attribute
EMPTY, NOT_RECORDED = "empty", "not recorded"
SAME_START = frozenset({EMPTY, ""})  # states a replay's optimizer can share with the reference's


def state_of(optimizers: Iterable) -> str:
    """The attribute's value for the optimizers about to step (torch optimizers; no torch import needed)."""
    optimizers = list(optimizers)
    if not optimizers:
        return ""
    held = any(len(state) for opt in optimizers for state in opt.state.values())
    return NOT_RECORDED if held else EMPTY


def updates_not_judged(reference: str, target: str, optimizer: str = "") -> Optional[str]:
    """Why a replay's parameter updates cannot be judged, in one line; None when they can. `reference` and
    `target` are the two files' `optimizer_state`, `optimizer` the target's optimizer name (its `optimizer`
    attribute)."""
    which = f" ({optimizer})" if optimizer else ""
    if target not in SAME_START:
        return (f"updates not judged: the target's optimizer{which} started this step with state from earlier steps "
                f"(momentum, moments) that a recording does not hold, so its update cannot be the reference's even "
                f"when every gradient matches; replay the first step, or a stateless optimizer, to judge updates")
    if reference not in SAME_START:
        return (f"updates not judged: the reference's optimizer{which} had state from earlier steps (momentum, "
                f"moments) that its recording does not hold, and the target's started without it; replay the first "
                f"step, or a stateless optimizer, to judge updates")
    return None
