"""`JudgedRow`: one row of the `/local` table while the probes build it (`probe.py`, `optimizer_rows.py`).

The row on disk is `format.layout.LocalRow` (the layout owns the format); this is its form in memory, which
knows where its capture moment is still to be looked up (`at`) and lets calibration fill in the noise later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

from oneiter.format.schema import ROOT_MODULE, LocalRow
from oneiter.runtime.precision import unit_roundoff

__all__ = ["JudgedRow", "LATE", "owner", "leaf", "dtype_name", "first_line"]

LATE = 1 << 62  # seq of a row whose moment never came in the real iteration (sorts last in its phase)

# a row's place in capture order: a seq, or (call key, "output" | "input" | "grad_input" | "grad_output") whose
# capture seq the session knows once the iteration is over
Moment = Union[int, tuple[str, str]]


@dataclass
class JudgedRow:
    """A judged tensor: the target's value against its reference (`rerun.tensor_stats`), and its noise once
    calibrated (NaN until then; `calibration` says where it was measured, or why it failed), and what the precision
    can produce for it on the trusted path (`noise_bound`, NaN where the noise needed no check). A call that runs a
    low-precision recipe is judged against the recipe's emulation instead (`recipe_rows.py`)."""

    module: str
    call: int
    phase: str
    tensor: str
    dtype: str
    stats: dict[str, Any]
    at: Moment = LATE
    noise_target: float = math.nan
    noise_reference: float = math.nan
    calibration: str = ""
    noise_bound: float = math.nan
    recipe: str = ""
    """The low-precision recipe the call runs (`recipe_rows.py`), "" for none."""
    recipe_rel_l2: float = math.nan
    """With a recipe: the deviation from its exact emulation (what is judged against the noise)."""
    format_cost: float = math.nan
    """With a recipe: its exact emulation against the reference (the format's own cost, never a fault)."""

    def needs_noise(self, run_roundoff: float) -> bool:
        """Whether its error could be flagged at all: above one unit roundoff of its dtype and of the run's
        compute precision (under bf16 autocast a float32 gradient is not expected to be closer than bf16's)."""
        return self.stats["rel_l2"] > max(unit_roundoff(self.dtype), run_roundoff)

    def local_row(self, seqs: dict[tuple[str, str], int]) -> LocalRow:
        """The row as `/local` stores it, its capture order looked up in `seqs` when it is a call's moment."""
        seq = self.at if isinstance(self.at, int) else seqs.get(self.at, LATE)
        return LocalRow(module=self.module, call=self.call, phase=self.phase, tensor=self.tensor, seq=seq,
                        dtype=self.dtype, **self.stats, noise_target=self.noise_target,
                        noise_reference=self.noise_reference, calibration=self.calibration,
                        noise_bound=self.noise_bound, recipe=self.recipe, recipe_rel_l2=self.recipe_rel_l2,
                        format_cost=self.format_cost)


def owner(name: str) -> str:
    """The module a parameter or buffer belongs to."""
    return name.rpartition(".")[0] or ROOT_MODULE


def leaf(name: str) -> str:
    return name.rpartition(".")[2]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
