"""A multi-step recording's per-step signature: the numbers a run of several iterations is compared on.

Where this sits: `record/steps/step_recorder.py` computes one row per recorded iteration while it records (the loss,
and per parameter the L2 norm of its gradient and of its update, in float64), the file keeps the rows as the table
`/signature` (and, in a replay, the rows of its perturbed twin as `/twin_signature`: docs/steps.md), and
`judge/stepwise/step_compare.py` compares two files' rows. This module owns the columns' names and what a row means; it
imports no torch.

Columns, in order: `loss`, then `grad:<parameter>` for every parameter, then `update:<parameter>` for every
parameter (`signature_columns`). A parameter without a gradient or an update this step has a norm of 0. The
comparison judges two groups of columns apart (`GROUPS`): `gradients` (the loss and the gradient norms: what the
step computed from its weights and batch) and `updates` (what the optimizer made of them; Adam-like optimizers
normalise each element, so their update norms react to other noise than the gradients do: docs/steps.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from oneiter.errors import FormatError

__all__ = ["LOSS_COLUMN", "GRAD", "UPDATE", "GROUPS", "signature_columns", "check_columns", "Signature"]

LOSS_COLUMN = "loss"
GRAD, UPDATE = "grad:", "update:"
GROUPS = {"gradients": (LOSS_COLUMN, GRAD), "updates": (UPDATE,)}  # group -> the column names' prefixes


def signature_columns(params: Sequence[str]) -> list[str]:
    """The columns of a signature row for these parameter names (module docstring)."""
    return [LOSS_COLUMN, *(GRAD + p for p in params), *(UPDATE + p for p in params)]


def check_columns(columns, width: int, params: set[str], where: str) -> None:
    """`columns` (a table's attribute) names `width` signature columns of the parameters `params`, in order."""
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise FormatError(f"{where}: attribute 'columns' must be a list of strings, got {type(columns).__name__}")
    if len(columns) != width:
        raise FormatError(f"{where}: {len(columns)} column names for {width} columns")
    names = [c[len(GRAD):] for c in columns if c.startswith(GRAD)]
    if columns != signature_columns(names):
        raise FormatError(f"{where}: columns must be 'loss', then 'grad:<parameter>' and 'update:<parameter>' for "
                          f"the same parameters in the same order")
    unknown = [n for n in names if n not in params]
    if unknown:
        raise FormatError(f"{where}: column 'grad:{unknown[0]}' names no parameter of the recording")


@dataclass(frozen=True)
class Signature:
    """The signature rows of one run: `steps` (iteration numbers), `columns` and `values` (rows x columns)."""

    steps: tuple[int, ...]
    columns: tuple[str, ...]
    values: np.ndarray

    def params(self) -> list[str]:
        return [c[len(GRAD):] for c in self.columns if c.startswith(GRAD)]

    def _part(self, prefix: str) -> np.ndarray:
        index = [i for i, c in enumerate(self.columns) if c.startswith(prefix)]
        return self.values[:, index]

    @property
    def loss(self) -> np.ndarray:
        return self.values[:, 0]

    @property
    def grad_norm(self) -> np.ndarray:
        """The gradient's L2 norm over every parameter, per step."""
        return np.sqrt(np.square(self._part(GRAD)).sum(axis=1))

    @property
    def update_norm(self) -> np.ndarray:
        """The update's L2 norm over every parameter, per step."""
        return np.sqrt(np.square(self._part(UPDATE)).sum(axis=1))

    def row(self, step: int) -> np.ndarray:
        return self.values[self.steps.index(step)]

    def aligned(self, other: "Signature", group: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """This run's and `other`'s values on the columns both have (of `group` only, if given: `GROUPS`), in this
        run's order (rows: the same steps)."""
        theirs = {c: i for i, c in enumerate(other.columns)}
        prefixes = GROUPS[group] if group is not None else ("",)
        index = [(i, theirs[c]) for i, c in enumerate(self.columns) if c in theirs and c.startswith(prefixes)]
        mine = self.values[:, [i for i, _ in index]]
        return mine, other.values[:, [j for _, j in index]]

