"""Local (per-call) error: each module call's *own* computation, rerun on trustworthy inputs, and its expected noise.

Where this sits: `ModuleCapture` hands every module call to a `LocalProbe` when the call returns (a
`CallRecord`: the call tree, the structure of its arguments and outputs, the random ops it ran). The probe reruns
the call (`rerun.py`) and writes one row per judged tensor into the recording's `/local` table
(`format.layout.LocalRow`); calls it cannot rerun go into `/unprobed` with the reason.

**What is judged.** A call's own code is everything its `forward` computes except what its children compute:
the rerun forces each child call that was itself probed (it returns the source's recorded output, and hands
back the source's recorded input gradient). Rows, per call:
- forward: its outputs, and the inputs it hands each child (`layer1.0.conv2@0:input.0`);
- backward: the gradient w.r.t. its inputs (`grad_input.0`, `grad_kwarg.hidden_states`), and the gradient it
  hands each child's outputs (`layer1.0.conv2@0:grad_output`);
and, once backward is over, one row per parameter gradient (the sum of every call's own contribution, phase
`param_grad`) and per parameter update (the target's optimizer stepped from the reference's weights and gradients, phase
`optimizer`: `optimizer_rows.py`). A leaf is a call with no children; the model itself is probed like any container, so
functional code in its own `forward` is judged too. A child whose own probe failed is not forced: it runs live inside
its parent, and its computation counts as the parent's.

**Checked against the live call.** Teacher forced, a call's rerun counts only where it reproduces the call as it
ran live (`fidelity.py`); a call whose rerun does not is listed in `/unprobed` as not reproducible, never cleared.

**Two modes** (who is trusted), one class each over the shared `LocalProbe`:
- `TeacherForcedProbe` (`record --replay`): the source is the reference file; each call of the target runs again
  on the target's device on the reference's inputs and output gradients; its results are judged against the
  reference's recorded values.
- `AgainstCpuProbe` (`record --against cpu`): the source is this run's own captured values; after backward, each call
  is recomputed on the CPU in float32 from the target's own inputs, and the target's values are judged against
  that. (Differences in the model's *code* cannot show in this mode: both sides run the same code.)

**Expected noise measures precision, not implementation.** A wrong kernel and a lower precision both make the
local error non-zero; only the first is a bug. The noise of a precision is measured on the *same code* run twice
on the same inputs, once in the run's precision (`low`) and once in a high precision (`high`):
`noise_target = rel_l2(low, high)`. Both runs execute the target's own Python code (a wrapped `forward`, a
patched class, a replaced torch function are in both), so a difference in the code cancels out of the noise and
stays in the local error. `noise_reference` is the same for the reference's precision. Where (`--calibrate`):
- `cpu` (default): both on the CPU, `high` in float64, with the reference's weights. Trusted kernels: a device
  kernel that is wrong only in low precision still shows; an op whose CPU kernel is not torch's own (a plugin's
  `torch.library` registration, a C++ extension's) runs through torch's own instead (`modes/trusted.py`; the
  /local attribute `foreign_kernels` names them and their routes). `--inject-fault` faults (they stand for device
  kernels) and `--fallback` do not apply there. Cost: two (three if the reference ran in another precision) CPU
  reruns of each calibrated call. A side whose float32 matmuls or convolutions ran TF32/HF32 (its `precision_modes`:
  `runtime/precision_modes.py`) has those ops' operands rounded the same way in its CPU rerun (`reduced.py`).
- `device`: `high` on the target device in a higher precision (float32 for bf16/fp16 runs, float64 for float32
  runs); `low` is the probed rerun itself. One extra device rerun per calibrated call. Its noise is held to the
  trusted CPU's (below): a kernel wrong only in the low precision gives a device noise the CPU's does not.

**A format written in the code is precision, not code.** A call whose module runs a low-precision recipe of the recipe
table (torchao's float8 Linears, MX: `recipes.py`) is not calibrated by these reruns (its code casts to float8 in
float64 too): its rows are judged against the recipe's exact emulation on the reference's inputs, with the
accumulation's noise, and carry the format's own cost (`recipe_rows.py`).

**A noise estimate is itself checked.** A calibrated noise (both sides) above `NOISE_BOUND_FACTOR` unit roundoffs
of the run's precision is checked against what the precision can produce for the call on the trusted path
(`_bound`: float64 reruns on the CPU with the run's rounding injected into every op, `modes/roundoff_mode.py`; with
`--calibrate device` also the CPU's own calibration of the call); the rows' `noise_bound`. The judge holds the
noise to it (`judge/iteration/blame.py`).
A call is calibrated only when one of its tensors is off by more than one unit roundoff of its dtype (below
that, nothing can flag it), or when a parameter it contributes to needs it. When the high run fails (an op
without float64: `torch._grouped_mm`), a bf16/fp16 run tries float32, else the noise is a Monte Carlo estimate
in the run's own precision (`montecarlo.py`); the rows' `calibration` says so (`cpu:float32`, `cpu:monte_carlo`).

**Where the code is.** This module holds the two modes and their factories; what they share, `LocalProbe`, is built
floor by floor in `probing/` (its map): its state, the noise bound, the calibration, the summed values, the calls'
probe and the entry points. `LocalProbe`, `MemorySource` are importable from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from oneiter.format.optimizer_state import OPTIMIZER_STATE, updates_not_judged
from oneiter.format.schema import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_MODULE,
    PARAM_GRADS,
    PRECISION_MODES,
    STATE_AFTER,
    STEP_GRADS,
    UNREDUCED_GRADS,
    group_path,
)
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.clipping import clip_row
from oneiter.record.local.fidelity import BackwardChecks, check_forward
from oneiter.record.local.optimizer_rows import check_updates, optimizer_rows
from oneiter.record.local.probing.base import LocalProbe
from oneiter.record.local.probing.noise import roundoff_of
from oneiter.record.local.probing.sources import MemorySource
from oneiter.record.local.rerun import AMBIENT, PROBED, Rerunner, RunResult, Site
from oneiter.record.local.rows import dtype_name, leaf, owner
from oneiter.record.modes.collectives import recorded_collectives
from oneiter.record.modes.randomness import recorded_random_ops
from oneiter.record.options import CALIBRATIONS
from oneiter.runtime.names import canonical
from oneiter.runtime.precision import amp_dtype_name, unit_roundoff
from oneiter.runtime.precision_modes import from_attr
from oneiter.runtime.sharding import grads_reduced

__all__ = ["PROBED", "LocalProbe", "TeacherForcedProbe", "AgainstCpuProbe", "MemorySource", "CALIBRATIONS",
           "teacher_forced_factory", "against_cpu_factory", "reference_precision"]

_CPU = torch.device("cpu")


class TeacherForcedProbe(LocalProbe):
    """`record --replay`: each call of the target reruns on the target's device, inside its own forward, on the
    reference's inputs and output gradients; judged against the reference's recorded values, once the rerun is
    shown to reproduce the live call (`fidelity.py`)."""

    KIND = "teacher_forced"
    PARAMS = "reference"
    CHECKS_LIVE = True

    def __init__(self, source, device, *, ref_optimizer_state: str = "", grads_reduced: bool = False, **kwargs):
        super().__init__(source, device, **kwargs)
        self.ref_optimizer_state = ref_optimizer_state  # the reference's `optimizer_state` (format/optimizer_state.py)
        # the reference's parameter gradients were reduced over ranks: each rank's own are its unreduced ones
        self.ref_grads_reduced = grads_reduced
        self.optimizer_start = ""  # the target's, as the Recorder found (or loaded) it when the step began
        # digests are bitwise: only where reruns are deterministic (the CPU)
        self.backward_checks = None
        if self.CHECKS_LIVE and self.device.type == "cpu":
            self.backward_checks = BackwardChecks(self.source.uncached)  # not a lambda over self: no cycle

    def _check(self, rec: CallRecord, primary: RunResult) -> None:
        if not self.CHECKS_LIVE:  # off only for bench/bench_isolation.py's A/B of what the check costs
            return
        live = Rerunner(None, self.device, self.rerunner.random_ops, self.rerunner.names)
        live._state = self.rerunner._state  # the starting states, read once for both
        live.collectives = self.rerunner.collectives

        def rerun(source) -> RunResult:
            live.source = source
            return live.run(rec, self._primary_site(), rec.forced())

        if check_forward(rec, primary, self.source, rerun) and self.backward_checks is not None:
            self.backward_checks.expect(rec, primary, self.source.read(),
                                        lambda path: self.source.tensor(path) if self.source.has(path) else None)

    def after_backward(self, *, step_later: bool = False) -> None:
        """The backward half of the fidelity check first: a call whose live backward its rerun does not reproduce
        loses its backward rows and is listed as not reproducible."""
        if self.backward_checks is not None:
            for module, call, grad, distance in self.backward_checks.failures():
                self.rows = [r for r in self.rows if not (r.module == module and r.call == call
                                                          and r.phase == BACKWARD)]
                self.unprobed.append((module, call, f"not reproducible from its inputs: fed exactly the reference's "
                                      f"values, its live backward gives another {grad} than its rerun (rel_l2 to "
                                      f"the reference's {distance:.1e} more)"))
        super().after_backward(step_later=step_later)

    def after_step(self) -> None:
        """Each parameter's live update against the checked shadow step's (`optimizer_rows.check_updates`)."""
        if self.model is None or not self._expected_updates:
            return
        failed = check_updates(self.model, self._expected_updates)
        self._expected_updates = {}
        if failed:
            gone = {(owner(name), leaf(name)) for name in failed}
            self.rows = [r for r in self.rows if not (r.phase == "optimizer" and (r.module, r.tensor) in gone)]
            for name in failed:
                self.unprobed.append(("(optimizer)", 0, f"not reproducible: a copy of the optimizer stepped "
                                          f"from the live weights and gradients does not give {name}'s live update"))

    def _primary_site(self, explicit: bool = False) -> Site:
        """The target's own rerun, inside its forward (so under the autocast the forward runs in); `explicit`:
        outside of it, with the run's autocast set here."""
        return Site("target", self.device, live=True, cast="live", autocast=self.amp if explicit else AMBIENT,
                    params="live", trusted=False)

    def _sides(self, stored, value):
        return stored, value

    def _stored_grad(self, name: str, param):
        """The reference's own gradient of this rank: as recorded, or before its reduction over ranks (DDP; under
        FSDP2 no rank's own gradient is recorded: not judged)."""
        path = group_path(UNREDUCED_GRADS if self.ref_grads_reduced else PARAM_GRADS, name)
        return self.source.uncached(path) if self.source.has(path) else None

    def _summed_grad_dtype(self, stored, param):
        return param.dtype

    def live_collective(self, record: CallRecord | None, phase: str, outputs: dict) -> None:
        """Forward: kept on the call whose own code ran it, until its probe (the fidelity check feeds a rerun these
        when they are not the reference's); every phase: their fingerprints, for the backward half of the check."""
        if phase == FORWARD and record is not None and self.CHECKS_LIVE:
            record.live_collectives.update((path, t.detach().clone()) for path, t in outputs.items())
        if self.backward_checks is not None:
            for path, tensor in outputs.items():
                self.backward_checks.live_tensor(path, tensor)

    def _rerun_primary(self, low_site: Site | None) -> bool:
        return low_site is None  # device calibration: the primary rerun is its low-precision side

    def _reference_run(self, rec: CallRecord, primary: RunResult | None) -> RunResult | None:
        site = self._reference_site_used = self._reference_site()
        return self._run(rec, site) if site is not None else None

    def _reference_sampling(self) -> tuple[Site, float] | None:
        site = self._reference_site()
        return None if site is None else (site, unit_roundoff(dtype_name(self.ref_precision[1] or
                                                                           self.ref_precision[0])))

    def _reference_site(self) -> Site | None:
        """The reference's own precision on the CPU, when it is not finer than the target's. Equal: its noise is
        ours; finer (a float32 reference for a bf16 target, an IEEE float32 one for a TF32 target): negligible
        next to ours, not measured. Its reduced-precision ops (a CUDA reference's TF32 convolutions) are rounded
        as it ran them."""
        if self._same_as_reference():
            return None
        ref_dtype, ref_amp = self.ref_precision or (dtype_name(self.dtype), self.amp)
        if roundoff_of(ref_dtype, ref_amp, self.ref_reduced) < roundoff_of(dtype_name(self.dtype), self.amp,
                                                                        self.reduced):
            return None
        return Site("reference", _CPU, live=False, cast="source", autocast=ref_amp, params="reference",
                    trusted=True, reduced=tuple(sorted(self.ref_reduced.items())))

    def _buffer_rows(self) -> None:
        """One row per buffer a single call updated (BatchNorm's running statistics) against its state_after."""
        assert self.model is not None  # bound: `after_backward` runs this only then
        names = [canonical(n) for n, _ in self.model.named_buffers()]
        for index, name in enumerate(names):
            records = self._contributors.get(name)
            judged = self._sums.get("primary", name)
            path = group_path(STATE_AFTER, name)
            if not records or judged is None or len(records) != 1:
                continue
            if not self.source.has(path) or tuple(self.source.tensor(path).shape) != tuple(judged.shape):
                continue
            row = self._row(owner(name), 0, "optimizer", leaf(name), self.source.tensor(path), judged,
                            (1 << 40) + index)
            if row.needs_noise(self.run_roundoff) and judged.is_floating_point():
                self._calibrated_value(name, records, row)
            self.rows.append(row)

    def before_step(self, *, grads_changed: bool, figures: dict | None = None) -> None:
        """The optimizer is about to step. `grads_changed`: code between backward and the step changed the
        gradients in place (clipping, unscaling). Where the reference's step saw changed gradients too
        (`/step_grads`), the change is judged as its own row (`clipping.clip_row`) and the update from the
        reference's step gradients; a change only one side made is listed, the update not judged."""
        if self.model is None or self.optimizer is None:
            return
        if updates_not_judged(self.ref_optimizer_state, self.optimizer_start):
            return  # another starting state: no update is judged, clipped or not; compare says why (from the files)
        theirs = self.source.attrs(STEP_GRADS)  # {}: the reference's step saw the gradients backward left
        if not theirs and grads_changed:
            self.unprobed.append((OPTIMIZER_MODULE, 0, "the gradients changed between backward and the step "
                                  "(gradient clipping or unscaling), where the reference's step saw them as backward "
                                  "left them: the update is not judged"))
            return
        if theirs:
            row, why = clip_row(theirs, figures) if figures is not None else (None, "sharded gradients: the "
                                                                               "clipping's total norm is no rank's")
            if row is not None:
                self.rows.append(row)
            else:
                self.unprobed.append((OPTIMIZER_MODULE, 0, why))
        rows, why = optimizer_rows(self.optimizer, self.model, self.rerunner, self.device,
                                   lambda row: row.needs_noise(0.0),  # the step runs outside autocast
                                   self._expected_updates if self.CHECKS_LIVE else None)
        if why:
            self.unprobed.append(("(optimizer)", 0, why))
        self.rows.extend(rows)


class AgainstCpuProbe(LocalProbe):
    """`record --against cpu`: after backward, each call is recomputed on the CPU in float32 from this run's own
    captured inputs; this run's values are judged against that recomputation (noise always on the CPU)."""

    KIND = "against_cpu"
    SOURCE_IS_RUN = True

    def __init__(self, source, device, **kwargs):
        super().__init__(source, device, **kwargs)
        self.where = "cpu"  # device calibration needs a reference's weights to rerun in a higher precision
        self._deferred: list[CallRecord] = []

    def after_call(self, rec: CallRecord) -> None:
        """A call returned: probed after backward, when every value it reruns from has been captured (unless it
        started from state an earlier call left: `carried.py`)."""
        if not self._not_alone(rec):
            self._deferred.append(rec)
        self._carried.leaving(rec)

    def after_backward(self, *, step_later: bool = False) -> None:
        for rec in self._deferred:
            if not rec.status.startswith("state carried"):  # an earlier call of a pair carrying state: not alone
                self._probe(rec)
        self._deferred.clear()
        super().after_backward(step_later=step_later)

    def _primary_site(self, explicit: bool = False) -> Site:
        return Site("cpu32", _CPU, live=False, cast="float32", autocast=None, params="live", trusted=True)

    def _sides(self, stored, value):
        return value, stored  # the CPU recomputation is the reference, this run's recorded value is judged

    def _stored_grad(self, name: str, param):
        if param.grad is None or _world_size() > 1:  # averaged over ranks by a reducer: not this rank's own sum
            return None
        kept = (self.kept_grads or {}).get(name)  # as the last backward left them: clipping may follow
        return kept if kept is not None else param.grad.detach().to(_CPU)

    def _summed_grad_dtype(self, stored, param):
        return stored.dtype

    def _rerun_primary(self, low_site: Site | None) -> bool:
        return True  # the primary rerun is the reference of the noise

    def _reference_run(self, rec: CallRecord, primary: RunResult | None) -> RunResult | None:
        return primary  # the float32 CPU recomputation is the reference here

    def _reference_sampling(self) -> tuple[Site, float] | None:
        return self._primary_site(), unit_roundoff("float32")


def teacher_forced_factory(ref, device, *, amp=None, dtype=None, calibrate: str = "cpu", modes=None):
    """A `RecordingSession` probe factory: teacher forced against the open reference `ref`. `modes`: this run's
    reduced-precision modes (`precision_modes.current`); the reference's are in its root attributes."""
    def factory(_sink):
        probe = TeacherForcedProbe(ref, device, amp=amp, dtype=dtype, calibrate=calibrate,
                                   ref_precision=reference_precision(ref.meta, amp, dtype),
                                   random_ops=recorded_random_ops(ref), modes=modes,
                                   ref_modes=from_attr(ref.meta.get(PRECISION_MODES)),
                                   ref_optimizer_state=str(ref.meta.get(OPTIMIZER_STATE) or ""),
                                   grads_reduced=grads_reduced(ref.meta))
        probe.collectives = recorded_collectives(ref)
        return probe

    return factory


def against_cpu_factory(device, *, amp=None, dtype=None, calibrate: str = "cpu", modes=None):
    """A `RecordingSession` probe factory: against a float32 CPU recomputation of the run's own kept values."""
    def factory(sink):
        return AgainstCpuProbe(MemorySource(sink.keep), device, amp=amp, dtype=dtype, calibrate=calibrate,
                               modes=modes, ref_modes={})

    return factory


def reference_precision(meta: dict, amp, dtype):
    """(storage dtype name, autocast dtype) of the reference when it differs from the target's, else None."""
    ref_dtype = str(meta.get("dtype") or "float32")
    ref_amp = _amp_dtype(meta.get("amp"))
    mine = (dtype_name(dtype or torch.float32), amp)
    return None if (ref_dtype, ref_amp) == mine else (ref_dtype, ref_amp)


def _amp_dtype(text):
    """The torch dtype of a recorded `amp` setting (None without autocast)."""
    name = amp_dtype_name(text)
    return getattr(torch, name) if name else None


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
