"""Whether a replay's optimizer started from the reference's state: the one rule that decides whether its
parameter updates can be judged.

Sits in the format layer because both sides read it from the files: the recorder writes the root attribute
`optimizer_state` (what the optimizer held when the recorded step began) and the group `/optimizer_state` (that
state itself: `record/start/optimizer_start.py`), the teacher-forced probe asks `updates_not_judged` before it steps a
copy of the optimizer (`record/local/probe.py`), and the engine asks it again before it judges the updated weights
(`judge/iteration/engine.py`). Values of the attribute:

- `empty`: the optimizer held nothing (a stateless one such as plain SGD, or any optimizer before its first step);
- `recorded`: it held state from earlier steps (SGD's momentum, Adam's moments and step count), and the file holds
  it in `/optimizer_state`;
- `loaded`: a replay whose optimizer was given the reference's recorded state before the step (its file holds
  that state too, as the target's optimizer held it: cast to its parameters' dtypes);
- `not recorded`: it held state the file does not hold (a file written before optimizer states were recorded; a
  state oneiter cannot store: a sharded (FSDP2) one, a value that is no tensor, a parameter outside the model);
- "" or absent: no optimizer, or a file written before the attribute existed (judged as before).

An update can equal the reference's only when both optimizers started from the same state: both empty, or the
target loaded the reference's recorded state (`SAME_START`).
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["OPTIMIZER_STATE", "EMPTY", "RECORDED", "LOADED", "NOT_RECORDED", "VALUES", "SAME_START", "state_of",
           "updates_not_judged"]

OPTIMIZER_STATE = "optimizer_state"  # the root attribute
EMPTY, RECORDED, LOADED, NOT_RECORDED = "empty", "recorded", "loaded", "not recorded"
VALUES = ("", EMPTY, RECORDED, LOADED, NOT_RECORDED)
SAME_START = frozenset({EMPTY, RECORDED, LOADED, ""})  # states a replay's optimizer can share with the reference's


def state_of(optimizers: Iterable) -> str:
    """Whether the optimizers about to step hold state: "" (none), `empty` or `not recorded` (they hold some; the
    recorder says `recorded` instead when it stores it: `record/start/optimizer_start.py`). No torch import needed."""
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
                f"(momentum, moments) that is not the reference's (the reference holds none to load), so its update "
                f"cannot be the reference's even when every gradient matches; record the reference again (recordings "
                f"now hold the optimizer's state), replay the first step, or a stateless optimizer, to judge updates")
    if reference not in SAME_START:
        return (f"updates not judged: the reference's optimizer{which} had state from earlier steps (momentum, "
                f"moments) that its recording does not hold, and the target's started without it; record the "
                f"reference again (recordings now hold the optimizer's state), replay the first step, or a stateless "
                f"optimizer, to judge updates")
    return None
