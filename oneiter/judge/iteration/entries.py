"""The entries of one comparison: an entry of both recordings compared (`Row`), one call's own error
(`LocalResult`), and the statuses a row can have.

The bottom of `judge/iteration/`: the engine makes `Row`s (`engine.py`), blame judges the target's `/local` table
into `LocalResult`s (`blame.py`), findings name them (`findings.py`) and the verdict settles their statuses
(`verdict.py`); every report reads them. Nothing here decides anything.

Row statuses: match, diverged, missing_in_target, missing_in_reference, shape_mismatch, dtype_mismatch, and, with
local data, drift (outside tolerance, but the call's own code is within noise: accumulated error) and rounding
(outside tolerance, but computed from values bitwise the reference's: the call's own error, within its noise);
not_judged for a parameter's update when the target's optimizer did not start from the reference's state
(`format/optimizer_state.py`: measured and shown, never judged); every other one is a divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from oneiter.format.schema import ROOT_MODULE, split_call_key, split_child_tensor
from oneiter.judge.measure.metrics import Metrics
from oneiter.judge.measure.tolerance import Tolerance

__all__ = ["PHASES", "STATUSES", "NOT_DIVERGED", "MEASURED", "NOT_JUDGED", "Key", "Row", "nan_inf_text",
           "LocalMetrics", "LocalResult"]

# row statuses of entries both sides hold with one shape and dtype
MEASURED = ("match", "diverged", "drift", "rounding")
# measured and shown, never evidence: a parameter's update when the optimizers did not start from the same state
NOT_JUDGED = "not_judged"
PHASES = ("forward", "backward", "param_grad", "optimizer")
STATUSES = ("match", "rounding", "drift", "diverged", NOT_JUDGED, "missing_in_target", "missing_in_reference",
            "shape_mismatch", "dtype_mismatch")
NOT_DIVERGED = ("match", "rounding", "drift", NOT_JUDGED)


class Key(NamedTuple):
    """What names one tensor of an iteration, the same in both recordings: a row's (`Row.key`), a call's own tensor's
    (`LocalResult.key`) and the row that tensor has in the report (`LocalResult.row_key`). A tuple: it equals, and
    hashes as, the plain `(module, call, phase, tensor)` a file's `Entry.key` gives."""

    module: str
    call: int
    phase: str
    tensor: str

    @property
    def param_grad(self) -> Key:
        """The key of a parameter's gradient (`param_grad`), for the key of its update (`optimizer`)."""
        return Key(self.module, 0, "param_grad", self.tensor)


@dataclass
class Row:
    """One entry of the comparison. `shape`/`dtype` are the reference's, `*_target` the target's (None if absent)."""

    module: str
    call: int
    phase: str
    tensor: str
    status: str
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    shape_target: Optional[tuple] = None
    dtype_target: Optional[str] = None
    tolerance: Optional[Tolerance] = None
    metrics: Optional[Metrics] = None
    reason: str = ""

    @property
    def key(self) -> Key:
        """(module, call, phase, tensor): the entry's key, as a `LocalResult.row_key` names it."""
        return Key(self.module, self.call, self.phase, self.tensor)

    @property
    def diverged(self) -> bool:
        """A divergence (drift, accumulated error whose calls are each within noise, is not; nor is rounding, a
        call's own error within its noise on values bitwise the reference's; nor an entry not judged)."""
        return self.status not in NOT_DIVERGED

    @property
    def name(self) -> str:
        """`layer1.0.conv1@0 forward output`: how reports name the entry."""
        return f"{self.module}@{self.call} {self.phase} {self.tensor}"

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready (shapes as lists; non-finite floats stay floats, see `CompareResult.to_json`)."""
        data = {**self.key._asdict(), "status": self.status, "nan_inf": nan_inf_text(self.metrics)}
        names = Metrics.__dataclass_fields__
        data.update(self.metrics.as_dict() if self.metrics else {k: None for k in names})
        data.update({
            "atol": self.tolerance.atol if self.tolerance else None,
            "rtol": self.tolerance.rtol if self.tolerance else None,
            "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype,
            "shape_target": None if self.shape_target is None else list(self.shape_target),
            "dtype_target": self.dtype_target, "reason": self.reason,
        })
        return data


def nan_inf_text(m: Optional[Metrics]) -> str:
    """`Inf 0|1`, `NaN 2|2 Inf 0|1`: the NaN and Inf counts, reference|target, of the kinds either side holds;
    "" when neither holds any. Reports show it before the metrics, which only see the finite elements."""
    if m is None:
        return ""
    kinds = (("NaN", m.num_nan_ref, m.num_nan_target), ("Inf", m.num_inf_ref, m.num_inf_target))
    return " ".join(f"{name} {ref}|{tgt}" for name, ref, tgt in kinds if ref or tgt)


@dataclass(frozen=True)
class LocalMetrics:
    """The numbers of one local row (what `/local` stores)."""

    num_elements: int
    rel_l2: float
    max_abs: float
    cosine: float
    num_nan_ref: int
    num_inf_ref: int
    num_nan_target: int
    num_inf_target: int
    num_mismatch: int

    @property
    def nonfinite_differs(self) -> bool:
        """NaN/Inf at other positions or with another sign than in the reference."""
        return self.num_mismatch > 0

    def as_metrics(self) -> Metrics:
        """The same numbers as a full `Metrics` (what the local table does not hold is NaN)."""
        nan = math.nan
        return Metrics(num_elements=self.num_elements, max_abs=self.max_abs, max_rel=nan, rel_l2=self.rel_l2,
                       cosine=self.cosine, num_out=self.num_mismatch,
                       frac_out=self.num_mismatch / self.num_elements if self.num_elements else 0.0, need_atol=nan,
                       need_rtol=nan, num_nan_ref=self.num_nan_ref, num_inf_ref=self.num_inf_ref,
                       num_nan_target=self.num_nan_target, num_inf_target=self.num_inf_target)


@dataclass
class LocalResult:
    """The local error of one tensor a module call's own code produced.

    `tensor` is the call's own (`output`, `grad_input.0`) or one it handed a child (`layer1.0.conv2@0:input.0`,
    `layer1.0.conv2@0:grad_output`); `row_key` is the accumulated entry the same tensor has in the report.
    """

    module: str
    call: int
    phase: str
    tensor: str
    dtype: str
    seq: int
    metrics: LocalMetrics
    calibrated: Optional[float]
    calibration: str
    expected: float
    factor: float
    flagged: bool
    bound: Optional[float] = None
    """What the precision can produce for the call, measured on the trusted path (None: not needed, not measured)."""
    rounding: bool = False
    """Whether the value is rounding itself: not flagged, and its expected noise (its precision's own error for it,
    relative to float64) is as large as the value (`blame.ROUNDING_NOISE`): a gradient that is 0 in exact arithmetic,
    such as a bias's before a BatchNorm."""
    recipe: str = ""
    """The low-precision recipe the call runs (`torchao.float8 tensorwise`), "" for none: then `error` is its
    deviation from the recipe's exact emulation and `format_cost` what the format itself costs."""
    recipe_rel_l2: float = math.nan
    format_cost: float = math.nan

    @property
    def untrusted(self) -> bool:
        """Whether its calibrated noise was far above `bound` and so not used (`expected` is the bound's)."""
        return self.calibrated is not None and self.bound is not None and self.calibrated > self.expected

    @property
    def key(self) -> Key:
        """The call's own tensor: (module, call, phase, tensor)."""
        return Key(self.module, self.call, self.phase, self.tensor)

    @property
    def row_key(self) -> Key:
        """The key of the row the same tensor has in the report (`Row.key`): a tensor handed to a child is the
        child's."""
        child = split_child_tensor(self.tensor)
        if child is None:
            return self.key
        module, call = split_call_key(child[0])
        return Key(module or ROOT_MODULE, call, self.phase, child[1])

    @property
    def rel_l2(self) -> float:
        """Its value against the reference's (with a recipe: the format's cost and the call's deviation together)."""
        return self.metrics.rel_l2

    @property
    def error(self) -> float:
        """What is judged against the expected noise: rel_l2, or with a recipe its deviation from the recipe."""
        return self.recipe_rel_l2 if self.recipe else self.metrics.rel_l2

    @property
    def ratio(self) -> float:
        """error / expected noise; inf when NaN/Inf differ (rel_l2 only sees the finite elements)."""
        if self.metrics.nonfinite_differs:
            return math.inf
        error = self.error if not math.isnan(self.error) else math.inf
        if self.expected:
            return error / self.expected
        return 0.0 if error == 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        """`rel_l2` is what is judged (`error`: with a recipe, the deviation from it; `reference_rel_l2` is then the
        value against the reference's, and `format_cost` the recipe's own)."""
        return {
            "module": self.module, "call": self.call, "tensor": self.tensor,
            "rel_l2": self.error, "max_abs": self.metrics.max_abs, "expected": self.expected,
            "calibrated": self.calibrated, "calibration": self.calibration or None, "ratio": self.ratio,
            "factor": self.factor, "flagged": self.flagged, "nan_mismatch": self.metrics.num_mismatch,
            "bound": self.bound, "calibration_trusted": not self.untrusted, "rounding": self.rounding,
            "recipe": self.recipe or None, "reference_rel_l2": self.rel_l2 if self.recipe else None,
            "format_cost": self.format_cost if self.recipe else None,
        }

    def verdict(self) -> dict[str, Any]:
        return {**self.key._asdict(), "local_rel_l2": self.error, "expected": self.expected, "ratio": self.ratio,
                "calibrated": self.calibrated, "nan_mismatch": self.metrics.num_mismatch}
