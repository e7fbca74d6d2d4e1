"""What a probe holds, and what each mode decides: the ground floor of `LocalProbe` (`base.py`).

Where this sits: `ProbeState` keeps the probe's settings (device, precision, where the noise is measured), its
rows and unprobed calls so far, its rerunner and sums; the modes (`probe.py`: `TeacherForcedProbe`,
`AgainstCpuProbe`) fill in its abstract methods. The floors above it: `bounds.py`, `calibration.py`, `summed_rows.py`,
`base.py`, each using only what lies below."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from oneiter.errors import OneIterError
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.carried import CarriedState
from oneiter.record.local.probing.sources import Cached, Sums
from oneiter.record.local.recipe_rows import RecipeRows
from oneiter.record.local.rerun import Rerunner, RunResult, Site, tensor_stats
from oneiter.record.local.rows import JudgedRow, Moment, dtype_name
from oneiter.record.modes import trusted
from oneiter.record.modes.collectives import RecordedCollective
from oneiter.record.modes.randomness import RecordedOp
from oneiter.record.options import CALIBRATIONS
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.precision_modes import reduced

__all__ = ["ProbeState"]


class ProbeState(ABC):
    """A probe's settings and what it has gathered so far; the abstract methods are what each mode decides (who is
    trusted, where the primary rerun runs, which parameters the calibration uses, what a parameter gradient is
    judged against)."""

    KIND = ""  # the /local table's `kind` attribute
    PARAMS = "live"  # whose weights the calibration reruns use: the live module's or the reference's
    SOURCE_IS_RUN = False  # the source is this run's own captured values (`--against cpu`), not a reference
    # the parameter gradients as the last backward left them, by name (`RecordingSession.keep_grads`), or None
    kept_grads: dict | None = None
    CHECKS_LIVE = False  # whether the capture hands each call's live inputs and outputs (`fidelity.py`)
    _reference_site_used: Site | None = None  # the site of the last reference run (`_reference_run`)

    def __init__(self, source, device, *, amp=None, dtype=None, calibrate: str = "cpu",
                 ref_precision=None, random_ops: list[RecordedOp] | None = None, modes: dict | None = None,
                 ref_modes: dict | None = None):
        if calibrate not in CALIBRATIONS:
            raise OneIterError(f"calibrate must be one of {', '.join(CALIBRATIONS)}, got '{calibrate}'")
        self.source = Cached(source)
        self.device = torch.device(device)
        self.amp = amp  # the run's autocast dtype, or None
        self.dtype = dtype or torch.float32  # the model's storage dtype
        self.run_roundoff = unit_roundoff(dtype_name(amp or self.dtype))  # of the run's compute precision
        self.calibrate = calibrate  # as asked (the table's attribute)
        self.where = calibrate  # where the noise is measured in fact
        self.ref_precision = ref_precision  # (dtype name, amp dtype) of the reference when it differs from ours
        # the float32 op families each side ran reduced (TF32 convolutions: `runtime/precision_modes.py`): the
        # CPU reruns standing for a side round those ops' operands the same way (`reduced.py`)
        self.reduced = reduced(modes)
        self.ref_reduced = reduced(ref_modes) if ref_modes is not None else dict(self.reduced)
        self._reduced_calls: dict[str, set[int]] = {"low": set(), "reference": set()}
        self.rows: list[JudgedRow] = []
        self.unprobed: list[tuple[str, int, str]] = []
        self.num_calls = 0
        self.rerunner = Rerunner(self.source, device, list(random_ops or []), {})
        self.model: torch.nn.Module | None = None  # the model being recorded, once bound (`bind`)
        self.optimizer = None
        self._sums = Sums()
        self._contributors: dict[str, list[CallRecord]] = {}
        self._carried = CarriedState()  # what calls left in their modules' attributes (`carried.py`)
        self._not_summed: set[str] = set()  # parameters a call contributed to whose backward is not judged alone
        self._expected_updates: dict[str, tuple] = {}  # parameter -> fingerprint of its checked update
        self._calibrated: dict[int, str] = {}  # id(call) -> how its noise was measured (the rows' `calibration`)
        self._bounds: dict[int, dict] = {}  # id(call) -> (phase, name) -> what the precision can produce (`_bound`)
        self._unbounded: list[dict[str, str]] = []  # the bounds that were needed and could not be measured, and why
        self._met = trusted.mark()  # the replaced kernels the calibration meets from here on (`table`)
        self._added: set[tuple[int, str]] = set()  # (id(call), sums site) already added to the sums
        self.recipes = RecipeRows(self.device.type)  # calls that run a low-precision recipe (`recipe_rows.py`)

    @property
    def random_ops(self) -> list[RecordedOp]:
        return self.rerunner.random_ops

    @random_ops.setter
    def random_ops(self, ops: list[RecordedOp]) -> None:
        self.rerunner.random_ops = ops

    @property
    def collectives(self) -> list[RecordedCollective]:
        """The source's collectives, which reruns force (`record/modes/collectives.py`)."""
        return self.rerunner.collectives

    @collectives.setter
    def collectives(self, items: list[RecordedCollective]) -> None:
        self.rerunner.collectives = items

    # -- what each mode decides -------------------------------------------------------------------------------------
    @abstractmethod
    def _primary_site(self, explicit: bool = False) -> Site:
        """The rerun whose results are judged (`explicit`: outside the live forward, with the run's autocast)."""

    @abstractmethod
    def _sides(self, stored, value) -> tuple[Any, Any]:
        """(reference, judged) of a recorded tensor `stored` and its rerun `value`."""

    @abstractmethod
    def _stored_grad(self, name: str, param):
        """The gradient a parameter's summed contributions are compared with (None: not judged)."""

    @abstractmethod
    def _summed_grad_dtype(self, stored, param):
        """The dtype the summed contributions are judged in."""

    @abstractmethod
    def _rerun_primary(self, low_site: Site | None) -> bool:
        """Whether calibration after backward needs the primary rerun again (it is not at hand then)."""

    @abstractmethod
    def _reference_run(self, rec: CallRecord, primary: RunResult | None) -> RunResult | None:
        """The run in the reference's precision that `noise_reference` is measured on (None: not measured)."""

    def _reference_sampling(self) -> tuple[Site, float] | None:
        """Where the reference's precision is sampled by Monte Carlo, and its unit roundoff (None: not measured)."""
        return None

    def _reference_site(self) -> Site | None:
        """The rerun standing for the reference's precision, where one is measured (teacher forced only)."""
        return None

    def _same_as_reference(self) -> bool:
        return self.ref_precision is None and self.ref_reduced == self.reduced

    def _reference_default(self, noise_target: float) -> float:
        """noise_reference when it was not measured: ours (same precision), or 0 (a finer reference precision)."""
        return noise_target if self._same_as_reference() else 0.0

    def _higher(self) -> str:
        low = self.amp is not None or self.dtype in (torch.bfloat16, torch.float16)
        return "float32" if low else "float64"

    def _run(self, rec: CallRecord, site: Site) -> RunResult:
        return self.rerunner.run(rec, site, rec.forced())

    def _row(self, module: str, call: int, phase: str, tensor: str, stored, value, at: Moment) -> JudgedRow:
        """A row: the judged value (the target's) against its reference, noise not yet measured."""
        reference, judged = self._sides(stored, value)
        return JudgedRow(module, call, phase, tensor, dtype_name(judged.dtype), tensor_stats(reference, judged),
                         at=at)

    def _add(self, rec: CallRecord, runs: dict[str, RunResult]) -> None:
        """Add a call's runs to the sums, each site once per call."""
        for site, run in runs.items():
            if (id(rec), site) not in self._added:
                self._added.add((id(rec), site))
                self._sums.add(site, run)
