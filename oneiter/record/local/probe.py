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

**A noise estimate is itself checked.** A calibrated noise (both sides) above `NOISE_BOUND_FACTOR` unit roundoffs
of the run's precision is checked against what the precision can produce for the call on the trusted path
(`_bound`: float64 reruns on the CPU with the run's rounding injected into every op, `modes/roundoff_mode.py`; with
`--calibrate device` also the CPU's own calibration of the call); the rows' `noise_bound`. The judge holds the
noise to it (`judge/iteration/blame.py`).
A call is calibrated only when one of its tensors is off by more than one unit roundoff of its dtype (below
that, nothing can flag it), or when a parameter it contributes to needs it. When the high run fails (an op
without float64: `torch._grouped_mm`), a bf16/fp16 run tries float32, else the noise is a Monte Carlo estimate
in the run's own precision (`montecarlo.py`); the rows' `calibration` says so (`cpu:float32`, `cpu:monte_carlo`).
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from oneiter.errors import OneIterError
from oneiter.format.optimizer_state import OPTIMIZER_STATE, updates_not_judged
from oneiter.format.schema import (
    BACKWARD,
    FOREIGN_KERNELS,
    FORWARD,
    OPTIMIZER_MODULE,
    PARAM_GRADS,
    PRECISION_MODES,
    REDUCED_CALLS,
    REDUCED_CALLS_REFERENCE,
    REDUCED_REFERENCE,
    REDUCED_TARGET,
    ROOT_MODULE,
    STATE_AFTER,
    STEP_GRADS,
    UNBOUNDED,
    UNREDUCED_GRADS,
    LocalRow,
    call_key,
    group_path,
    tensor_path,
)
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.carried import CarriedState
from oneiter.record.local.clipping import clip_row
from oneiter.record.local.fidelity import BackwardChecks, check_forward
from oneiter.record.local.montecarlo import BOUND_SAMPLES, MONTE_CARLO, SAMPLES, SEED, spread
from oneiter.record.local.optimizer_rows import check_updates, optimizer_rows
from oneiter.record.local.rerun import AMBIENT, PROBED, ProbeSkip, Rerunner, RunResult, Site, rel_l2, tensor_stats
from oneiter.record.local.rows import JudgedRow, Moment, dtype_name, first_line, leaf, owner
from oneiter.record.modes import trusted
from oneiter.record.modes.collectives import RecordedCollective, recorded_collectives
from oneiter.record.modes.randomness import RecordedOp, recorded_random_ops
from oneiter.record.options import CALIBRATIONS
from oneiter.runtime import kernels
from oneiter.runtime.names import canonical, parameters, tensor_names
from oneiter.runtime.precision import NOISE_BOUND_FACTOR, amp_dtype_name, unit_roundoff
from oneiter.runtime.precision_modes import MANTISSA_BITS, from_attr, reduced
from oneiter.runtime.sharding import grads_reduced

__all__ = ["PROBED", "LocalProbe", "TeacherForcedProbe", "AgainstCpuProbe", "MemorySource", "CALIBRATIONS",
           "teacher_forced_factory", "against_cpu_factory", "reference_precision"]

_CPU = torch.device("cpu")
_LISTED = 20  # the device's ops whose kernels are not torch's own, listed in /local's FOREIGN_KERNELS at most


class MemorySource:
    """The source for `--against cpu`: this run's own captured host copies, by path (`TensorSink.keep`)."""

    def __init__(self, store: dict):
        self.store = store

    def has(self, path: str) -> bool:
        return self.store.get(path) is not None

    def tensor(self, path: str):
        return self.store[path]


class _Cached:
    """A source that remembers what it read until `clear()`: one call's probe reads the same tensors in its
    primary rerun, its calibration reruns and its judgement."""

    def __init__(self, source):
        self.inner = source
        self._seen: dict[str, Any] = {}

    def has(self, path: str) -> bool:
        return path in self._seen or self.inner.has(path)

    def tensor(self, path: str):
        if path not in self._seen:
            self._seen[path] = self.inner.tensor(path)
        return self._seen[path]

    def clear(self) -> None:
        self._seen.clear()

    def attrs(self, path: str) -> dict:
        """The attributes the source stored with `path` (a shard's placements), {} where it keeps none."""
        attrs = getattr(self.inner, "attrs", None)
        return attrs(path) if callable(attrs) else {}

    def read(self) -> dict:
        """What was read since `clear()`, by path."""
        return dict(self._seen)

    def uncached(self, path: str):
        """A read that is not remembered: the parameter-gradient and optimizer rows read each parameter's
        gradient and state_after once; cached, they would stay in memory for the whole model at once."""
        return self._seen[path] if path in self._seen else self.inner.tensor(path)

    def cached(self, path: str) -> bool:
        """Whether `uncached(path)` hands out the remembered tensor (shared: copy before changing it)."""
        return path in self._seen


class _Sums:
    """Per site: the running sum of each parameter's gradient contributions (on the CPU: a single contribution as
    it is, from the second on in float64), and the last value each changed buffer took."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, Any]] = {}

    def add(self, site: str, run: RunResult) -> None:
        mine = self.sums.setdefault(site, {})
        for name, grad in run.param_grads.items():
            grad = grad.detach().to(_CPU)  # most parameters have one contributing call: no float64 copy of those
            mine[name] = grad if name not in mine else mine[name].to(torch.float64) + grad
        for name, value in run.buffers.items():
            mine[name] = value.detach().to(_CPU)

    def get(self, site: str, name: str):
        return self.sums.get(site, {}).get(name)


class LocalProbe(ABC):
    """Reruns module calls and measures their local error and expected noise (see the module docstring).

    What both modes share lives here; what differs (who is trusted, where the primary rerun runs, which
    parameters the calibration uses, what a parameter gradient is judged against) is in `TeacherForcedProbe`
    and `AgainstCpuProbe`."""

    KIND = ""  # the /local table's `kind` attribute
    PARAMS = "live"  # whose weights the calibration reruns use: the live module's or the reference's

    def __init__(self, source, device, *, amp=None, dtype=None, calibrate: str = "cpu",
                 ref_precision=None, random_ops: list[RecordedOp] | None = None, modes: dict | None = None,
                 ref_modes: dict | None = None):
        if calibrate not in CALIBRATIONS:
            raise OneIterError(f"calibrate must be one of {', '.join(CALIBRATIONS)}, got '{calibrate}'")
        self.source = _Cached(source)
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
        self.model = None
        self.optimizer = None
        self._sums = _Sums()
        self._contributors: dict[str, list[CallRecord]] = {}
        self._carried = CarriedState()  # what calls left in their modules' attributes (`carried.py`)
        self._not_summed: set[str] = set()  # parameters a call contributed to whose backward is not judged alone
        self._expected_updates: dict[str, tuple] = {}  # parameter -> fingerprint of its checked update
        self._calibrated: dict[int, str] = {}  # id(call) -> how its noise was measured (the rows' `calibration`)
        self._bounds: dict[int, dict] = {}  # id(call) -> (phase, name) -> what the precision can produce (`_bound`)
        self._unbounded: list[dict[str, str]] = []  # the bounds that were needed and could not be measured, and why
        self._met = trusted.mark()  # the replaced kernels the calibration meets from here on (`table`)
        self._added: set[tuple[int, str]] = set()  # (id(call), sums site) already added to the sums

    @property
    def random_ops(self) -> list[RecordedOp]:
        return self.rerunner.random_ops

    @random_ops.setter
    def random_ops(self, ops: list[RecordedOp]) -> None:
        self.rerunner.random_ops = ops

    SOURCE_IS_RUN = False  # the source is this run's own captured values (`--against cpu`), not a reference
    # the parameter gradients as the last backward left them, by name (`RecordingSession.keep_grads`), or None
    kept_grads: dict | None = None

    @property
    def collectives(self) -> list[RecordedCollective]:
        """The source's collectives, which reruns force (`record/modes/collectives.py`)."""
        return self.rerunner.collectives

    @collectives.setter
    def collectives(self, items: list[RecordedCollective]) -> None:
        self.rerunner.collectives = items

    def live_collective(self, record: CallRecord | None, phase: str, outputs: dict) -> None:  # noqa: B027 - a hook
        """A collective's live outputs by path, run by `record`'s own code in `phase` (the fidelity check's)."""

    def bind(self, model, optimizer=None) -> None:
        """The model being recorded (canonical parameter names) and its optimizer (the `optimizer` rows)."""
        self.model = model
        self.optimizer = optimizer
        self.rerunner.names = tensor_names(model)

    # -- entry points -----------------------------------------------------------------------------------------------
    def after_call(self, rec: CallRecord) -> None:
        """A call returned: probed, unless it started from state an earlier call left (`carried.py`)."""
        if not self._not_alone(rec):
            self._probe(rec)
        self._carried.leaving(rec)

    def _not_alone(self, rec: CallRecord) -> bool:
        """Whether `rec` started from a tensor an earlier call left on a module: then neither is probed alone, both
        run live in their caller's rerun (`carried.py`); the earlier one loses its backward rows and its parameters'
        gradient rows (which its rerun summed without the gradient that reached it through the attribute)."""
        found = self._carried.started_from(rec)
        if found is None:
            return False
        earlier, attribute = found
        module = earlier.path or ROOT_MODULE
        why = (f"state carried between calls: {rec.key} starts from the tensor {earlier.key} left in {attribute}, "
               f"whose gradient reaches {earlier.key} through that attribute; both run in their caller's rerun")
        if earlier.status == PROBED:
            self.rows = [r for r in self.rows if not (r.module == module and r.call == earlier.call
                                                      and r.phase == BACKWARD)]
            self._not_summed |= {n for n, calls in self._contributors.items() if any(c is earlier for c in calls)}
            if getattr(self, "backward_checks", None) is not None:
                self.backward_checks.forget(module, earlier.call)
        if not earlier.status.startswith("state carried"):
            earlier.status = why
            self.unprobed.append((module, earlier.call, why))
        rec.status = why
        self.unprobed.append((rec.path or ROOT_MODULE, rec.call, why))
        rec.release()
        return True

    def after_backward(self, *, step_later: bool = False) -> None:
        """Backward is over, the optimizer has not stepped: parameter gradients, buffer updates and (unless
        `step_later`: then `before_step` does it) the optimizer."""
        if self.model is not None:
            self._param_rows()
            self._buffer_rows()
            if not step_later:
                self.before_step(grads_changed=False, figures=None)
        for records in self._contributors.values():
            for rec in records:
                rec.release()
        self._contributors.clear()

    def before_step(self, *, grads_changed: bool, figures: dict | None = None) -> None:  # noqa: B027 - a hook
        """The optimizer is about to step: its update is judged only teacher-forced (`TeacherForcedProbe`).
        `figures`: the gradients as the step sees them against what backward left (`clipping.step_figures`)."""

    def table(self, seqs: dict[tuple[str, str], int]) -> tuple[list[LocalRow], list[tuple[str, int, str]], dict]:
        """The `/local` rows (capture order filled in from `seqs`), the unprobed calls, and the table's attrs."""
        rows = [row.local_row(seqs) for row in self.rows]
        attrs = {"kind": self.KIND, "calibrate": self.calibrate, "num_calls": self.num_calls,
                 "num_unprobed": len(self.unprobed)}
        attrs.update(self._reduced_attrs())
        attrs[FOREIGN_KERNELS] = json.dumps(self._foreign(), sort_keys=True)
        attrs[UNBOUNDED] = json.dumps(self._unbounded)
        return rows, list(self.unprobed), attrs

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

    def _buffer_rows(self) -> None:  # noqa: B027 - a hook: a no-op unless a mode overrides it
        """Rows for buffers a call updated: only where the source holds their state_after (teacher forced)."""

    CHECKS_LIVE = False  # whether the capture hands each call's live inputs and outputs (`fidelity.py`)

    def _check(self, rec: CallRecord, primary: RunResult) -> None:  # noqa: B027 - a hook
        """Raise ProbeSkip when the rerun does not reproduce the live call (`fidelity.py`; teacher forced)."""

    def after_step(self) -> None:  # noqa: B027 - a hook: a no-op unless a mode overrides it
        """The optimizer has stepped (state_after is taken): check the shadow step against it (teacher forced)."""

    def _reference_sampling(self) -> tuple[Site, float] | None:
        """Where the reference's precision is sampled by Monte Carlo, and its unit roundoff (None: not measured)."""
        return None

    # -- module calls -----------------------------------------------------------------------------------------------
    def _probe(self, rec: CallRecord) -> None:
        self.num_calls += 1
        module = rec.path or ROOT_MODULE
        try:
            primary = self._run(rec, self._primary_site())
            self._check(rec, primary)
            judged = self._judge(rec, primary)
            if any(row.needs_noise(self.run_roundoff) for row in judged):
                self._calibrate(rec, primary, judged)
        except ProbeSkip as skip:
            rec.status = str(skip)
        except OneIterError as err:
            rec.status = f"rerun refused: {first_line(err)}"
        except Exception as err:  # the user's code failed in the rerun: this call is not judged, the run goes on
            rec.status = f"rerun failed: {type(err).__name__}: {first_line(err)}"
        else:
            rec.status = PROBED
            rec.internal = {n: g.to(_CPU) for n, g in primary.internal.items()}
            self.rows.extend(judged)
            self._sums.add("primary", primary)
            for name in (*primary.param_grads, *primary.buffers):
                self._contributors.setdefault(name, []).append(rec)
        live, rec.live_collectives = rec.live_collectives, {}
        if rec.status != PROBED:
            self.unprobed.append((module, rec.call, rec.status))
            if rec.parent is not None:  # it runs live in its caller's rerun: so do its collectives
                rec.parent.live_collectives.update(live)
        if rec.status != PROBED or not (primary.param_grads or primary.buffers):
            rec.release()
        self.source.clear()

    def _run(self, rec: CallRecord, site: Site) -> RunResult:
        return self.rerunner.run(rec, site, rec.forced())

    def _judge(self, rec: CallRecord, run: RunResult) -> list[JudgedRow]:
        """One row per produced tensor (values that merely pass on a forced/given tensor are skipped)."""
        judged = []
        for phase, produced in ((FORWARD, run.forward), (BACKWARD, run.backward)):
            for name, value in produced.items():
                if (phase, name) in run.passed:
                    continue
                path, at = _source_path(rec, phase, name)
                if not self.source.has(path):
                    continue
                stored = self.source.tensor(path)
                if tuple(stored.shape) != tuple(value.shape):
                    raise ProbeSkip(f"the rerun's {name} has shape {list(value.shape)}, the recorded one "
                                    f"{list(stored.shape)}")
                judged.append(self._row(rec.path or ROOT_MODULE, rec.call, phase, name, stored, value, at))
        return judged

    def _row(self, module: str, call: int, phase: str, tensor: str, stored, value, at: Moment) -> JudgedRow:
        """A row: the judged value (the target's) against its reference, noise not yet measured."""
        reference, judged = self._sides(stored, value)
        return JudgedRow(module, call, phase, tensor, dtype_name(judged.dtype), tensor_stats(reference, judged),
                         at=at)

    # -- calibration ------------------------------------------------------------------------------------------------
    def _calibrate(self, rec: CallRecord, primary: RunResult, judged: list[JudgedRow]) -> None:
        """Measure the expected noise of every judged tensor of this call (and its parameter contributions)."""
        try:
            noise_t, noise_r, where = self._noise(rec, primary)
        except (ProbeSkip, OneIterError):
            raise
        except Exception as err:
            raise ProbeSkip(f"calibration failed: {type(err).__name__}: {first_line(err)}") from None
        bound = self._bounds.get(id(rec), {})
        for row in judged:
            key = (row.phase, row.tensor)
            if key in noise_t:
                row.noise_target = noise_t[key]
                row.noise_reference = noise_r.get(key, self._reference_default(noise_t[key]))
                row.calibration = where
                row.noise_bound = bound.get(key, math.nan)

    def _noise(self, rec: CallRecord, primary: RunResult | None):
        """(noise_target, noise_reference, how) by (phase, name); parameter contributions go into the sums.
        `primary` None: this call's primary rerun is not at hand (calibration after backward) and is redone if
        needed, with the run's autocast set explicitly. `how`: where, and `:float32`/`:monte_carlo` when the
        high-precision run failed (an op without a float64 kernel) and the noise was estimated without it."""
        high_site, low_site, where = self._calibration_sites()
        if primary is None and self._rerun_primary(low_site):
            primary = self._run(rec, self._primary_site(explicit=True))
        low = primary if low_site is None else self._run(rec, low_site)
        self._note_reduced("low", low_site, rec)
        reference = self._reference_run(rec, primary)
        self._note_reduced("reference", self._reference_site_used, rec)
        high, how = self._high(rec, high_site, where)
        if high is None:
            noise_t, noise_r = self._monte_carlo(rec, low_site, low, reference)
        else:
            noise_t = _rel_all(low, high)
            noise_r = _rel_all(reference, high) if reference is not None else {}
            self._add(rec, {"high": high})
            if how == where and self._suspicious(noise_t, noise_r):
                try:
                    self._bounds[id(rec)] = self._bound(rec, high)
                except (ProbeSkip, OneIterError):
                    raise
                except Exception as err:  # noqa: BLE001 - the check could not be made: the noise stands unchecked,
                    self._not_bounded(call_key(rec.path, rec.call), err)  # and the report says so
        self._add(rec, {"low": low, **({"reference": reference} if reference is not None else {})})
        self._calibrated.setdefault(id(rec), how)
        return noise_t, noise_r, how

    def _high(self, rec: CallRecord, site: Site, where: str) -> tuple[RunResult | None, str]:
        """The high-precision run and how the noise is labelled; float32 when float64 fails in a coarser run
        (bf16, fp16); (None, where:monte_carlo) when no higher precision runs."""
        try:
            return self._run(rec, site), where
        except (ProbeSkip, OneIterError):
            raise
        except Exception:
            if site.cast != "float64" or self.run_roundoff <= unit_roundoff("float32"):
                return None, f"{where}:{MONTE_CARLO}"
        try:
            return self._run(rec, replace(site, cast="float32")), f"{where}:float32"
        except (ProbeSkip, OneIterError):
            raise
        except Exception:
            return None, f"{where}:{MONTE_CARLO}"

    def _monte_carlo(self, rec: CallRecord, low_site: Site | None, low: RunResult, reference: RunResult | None):
        """The noise without a higher precision: `SAMPLES` reruns in the run's own precision, inputs
        and weights perturbed at its unit roundoff (`rerun.Perturbation`), each against the unperturbed run; the
        RMS of their rel_l2, scaled (`montecarlo.py`, docs/blame.md). The same for the reference's precision
        when it is measured. The samples go into the sums (`mc<k>`, `mc_ref<k>`) for the parameter rows."""
        base_site = low_site or Site("low", self.device, live=False, cast="live", autocast=self.amp, params="live",
                                     trusted=False)
        base = low if low_site is not None else self._run(rec, base_site)
        runs = {"mc_base": base}
        samples = [self._run(rec, replace(base_site, name=f"mc{k}", perturb=(SEED + k, self.run_roundoff)))
                   for k in range(SAMPLES)]
        runs.update((f"mc{k}", run) for k, run in enumerate(samples))
        noise_t = _spread(base, samples)
        noise_r: dict = {}
        sampling = self._reference_sampling() if reference is not None else None
        if sampling is not None:
            site, roundoff = sampling
            refs = [self._run(rec, replace(site, name=f"mc_ref{k}", perturb=(SEED + k, roundoff)))
                    for k in range(SAMPLES)]
            noise_r = _spread(reference, refs)
            runs.update((f"mc_ref{k}", run) for k, run in enumerate(refs))
            runs["mc_ref_base"] = reference
        self._add(rec, runs)
        return noise_t, noise_r

    def _add(self, rec: CallRecord, runs: dict[str, RunResult]) -> None:
        """Add a call's runs to the sums, each site once per call."""
        for site, run in runs.items():
            if (id(rec), site) not in self._added:
                self._added.add((id(rec), site))
                self._sums.add(site, run)

    def _calibration_sites(self) -> tuple[Site, Site | None, str]:
        if self.where == "device":
            high = Site("high", self.device, live=False, cast=self._higher(), autocast=None, params=self.PARAMS,
                        trusted=False)
            return high, None, "device"
        high = Site("high", _CPU, live=False, cast="float64", autocast=None, params=self.PARAMS, trusted=True)
        low = Site("low", _CPU, live=False, cast="live", autocast=self.amp, params="live", trusted=True,
                   reduced=tuple(sorted(self.reduced.items())))
        return high, low, "cpu"

    # -- the check of a noise estimate -------------------------------------------------------------------------
    def _gate(self) -> float:
        """A calibrated noise (target's plus reference's) above this is checked against what the precision can
        produce (`_bound`): NOISE_BOUND_FACTOR unit roundoffs of the coarser side's precision, reduced modes
        (TF32) included. Below it no check could fail."""
        mine = _roundoff(dtype_name(self.dtype), self.amp, self.reduced)
        if self._reference_site() is not None:
            ref_dtype, ref_amp = self.ref_precision or (dtype_name(self.dtype), self.amp)
            mine = max(mine, _roundoff(ref_dtype, ref_amp, self.ref_reduced))
        return NOISE_BOUND_FACTOR * mine

    def _suspicious(self, noise_t: dict, noise_r: dict) -> bool:
        gate = self._gate()
        return any(v + noise_r.get(k, self._reference_default(v)) > gate for k, v in noise_t.items())

    def _bound(self, rec: CallRecord, high: RunResult | None) -> dict[tuple[str, str], float]:
        """What the precision can produce for each tensor of this call, measured on the trusted path (the CPU,
        torch's kernels): the spread of `BOUND_SAMPLES` float64 runs with the run's rounding injected into every
        op (`roundoff_mode.py`) around the plain float64 run; with `--calibrate device`, at least the trusted CPU's
        own noise (the run's precision, its reduced modes rounded as it ran them, against float64). Both sides:
        the reference's part scaled by its roundoff (none when finer). The runs go into the sums (`bound_*`,
        `inj<k>`) for the parameter rows."""
        base_site = Site("high", _CPU, live=False, cast="float64", autocast=None, params=self.PARAMS, trusted=True)
        label = "high" if self.where == "cpu" else "bound_high"
        base = high if self.where == "cpu" and high is not None else self._run(rec, base_site)
        runs = {label: base}
        if self.where == "device":
            runs["bound_low"] = self._run(rec, Site("bound_low", _CPU, live=False, cast="live", autocast=self.amp,
                                                    params="live", trusted=True,
                                                    reduced=tuple(sorted(self.reduced.items()))))
        roundoff = unit_roundoff(dtype_name(self.amp or self.dtype))
        families = tuple(sorted(self.reduced.items())) if self.amp is None and self.dtype == torch.float32 else ()
        for k in range(BOUND_SAMPLES):
            runs[f"inj{k}"] = self._run(rec, replace(base_site, name=f"inj{k}", inject=(
                SEED + k, roundoff, min(roundoff, unit_roundoff("float32")), families)))
        self._add(rec, runs)
        spread_t = _spread(base, [runs[f"inj{k}"] for k in range(BOUND_SAMPLES)], 1.0)
        cpu = _rel_all(runs["bound_low"], base) if "bound_low" in runs else {}
        both = 1.0 + self._reference_bound_scale()
        return {key: max(value, cpu.get(key, 0.0)) * both for key, value in spread_t.items()}

    def _summed_bound(self, name: str) -> float | None:
        """`_bound` of a value summed over calls (a parameter's gradient, a buffer's update), from the sums."""
        base = self._sums.get("high" if self.where == "cpu" else "bound_high", name)
        samples = [self._sums.get(f"inj{k}", name) for k in range(BOUND_SAMPLES)]
        if base is None or any(s is None for s in samples):
            return None
        low = self._sums.get("bound_low", name)
        value = max(spread(base, samples, 1.0), rel_l2(base, low) if low is not None else 0.0)
        return value * (1.0 + self._reference_bound_scale())

    def _reference_bound_scale(self) -> float:
        """The reference's share of a bound, relative to the target's: 1 in the same precision, the ratio of their
        roundoffs where the reference's run is measured, 0 where it is finer (not measured)."""
        if self._same_as_reference():
            return 1.0
        site = self._reference_site()
        if site is None:
            return 0.0
        ref_dtype, ref_amp = self.ref_precision or (dtype_name(self.dtype), self.amp)
        return (_roundoff(ref_dtype, ref_amp, self.ref_reduced)
                / _roundoff(dtype_name(self.dtype), self.amp, self.reduced))

    def _foreign(self) -> dict:
        """The kernels that were not torch's own where the calibration ran (`FOREIGN_KERNELS`): the CPU ops its
        trusted reruns met and the route each took (and aten ops whose backward formula was replaced: no rerun can
        route those); for a target on a device, that device's ops."""
        found: dict = {"cpu": trusted.met_kernels(self._met)}
        if self.device.type != "cpu":
            ops = kernels.foreign(self.device.type)
            found["device"] = {"type": self.device.type, "plugin": kernels.is_plugin_backend(self.device.type),
                               "num_ops": len(ops), "ops": [{"op": f.op, "key": f.key, "registered": f.registered}
                                                            for f in ops[:_LISTED]]}
        return found

    _reference_site_used: Site | None = None  # the site of the last reference run (`_reference_run`)

    def _note_reduced(self, side: str, site: Site | None, rec: CallRecord) -> None:
        """Count the call when the rerun standing for `side` rounded operands of a governed op."""
        if site is not None and site.reduced and self.rerunner.rounded:
            self._reduced_calls[side].add(id(rec))

    def _reduced_attrs(self) -> dict:
        """The /local attributes saying which reduced modes the calibration reproduced, and for how many calls."""
        low = self.reduced if self.where == "cpu" else {}  # device calibration: the device runs its own modes
        site = self._reference_site()
        ref = dict(site.reduced) if site is not None else {}
        return {REDUCED_TARGET: json.dumps(low, sort_keys=True), REDUCED_CALLS: len(self._reduced_calls["low"]),
                REDUCED_REFERENCE: json.dumps(ref, sort_keys=True),
                REDUCED_CALLS_REFERENCE: len(self._reduced_calls["reference"])}

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

    # -- parameter gradients ----------------------------------------------------------------------------------------
    def _param_rows(self) -> None:
        """One row per parameter gradient: the sum of every call's own contribution, judged like any tensor."""
        for index, (name, param) in enumerate(parameters(self.model)):
            records = self._contributors.get(name)
            judged = self._sums.get("primary", name)
            if not records or judged is None or name in self._not_summed:
                continue
            stored = self._stored_grad(name, param)
            if stored is None or tuple(stored.shape) != tuple(judged.shape):
                continue
            row = self._row(owner(name), 0, "param_grad", leaf(name), stored,
                            judged.to(self._summed_grad_dtype(stored, param)), index)
            if row.needs_noise(self.run_roundoff):
                self._calibrated_value(name, records, row)
            self.rows.append(row)

    def _calibrated_value(self, name: str, records: list[CallRecord], row: JudgedRow) -> None:
        """Noise of a parameter gradient (summed over calls) or of a buffer's update, calibrating calls as needed.
        When any contributing call had no high-precision run, every one is sampled and the sums' spread is used."""
        try:
            for rec in records:
                if id(rec) not in self._calibrated:
                    self._noise(rec, None)
                    self.source.clear()
            sampled = any(self._calibrated[id(rec)].endswith(MONTE_CARLO) for rec in records)
            for rec in records if sampled else ():
                if (id(rec), "mc0") not in self._added:
                    self._monte_carlo_again(rec)
        except Exception as err:
            row.calibration = f"failed: {type(err).__name__}: {first_line(err)}"[:200]
            return
        if sampled:
            self._sampled_value(name, row)
            return
        high, low = self._sums.get("high", name), self._sums.get("low" if self.where == "cpu" else "primary", name)
        if high is None or low is None:
            return
        row.noise_target = rel_l2(high, low)
        ref = self._sums.get("reference", name)
        row.noise_reference = rel_l2(high, ref) if ref is not None else self._reference_default(row.noise_target)
        row.calibration = self._calibrated[id(records[0])].partition(":")[0] + (
            ":float32" if any(self._calibrated[id(r)].endswith("float32") for r in records) else "")
        if row.noise_target + row.noise_reference > self._gate() and not row.calibration.endswith("float32"):
            self._check_summed(name, records, row)

    def _check_summed(self, name: str, records: list[CallRecord], row: JudgedRow) -> None:
        """The bound of a summed value (`_summed_bound`), measuring each contributing call's bound runs first."""
        try:
            for rec in records:
                if (id(rec), "inj0") not in self._added:
                    self._bound(rec, None)
                    self.source.clear()
        except Exception as err:  # noqa: BLE001 - the check could not be made: the noise stands unchecked (NaN
            self._not_bounded(name, err)  # bound), and the report says so
            return
        bound = self._summed_bound(name)
        if bound is None:
            self._not_bounded(name, "a contributing call's bound runs are missing")
        row.noise_bound = math.nan if bound is None else bound

    def _not_bounded(self, what: str, why) -> None:
        """A noise bound that was needed (the calibrated noise is above the gate) and could not be measured: kept
        for `/local`'s UNBOUNDED attribute, which every report states."""
        reason = why if isinstance(why, str) else f"{type(why).__name__}: {first_line(why)}"
        self._unbounded.append({"what": what, "reason": reason[:200]})

    def _monte_carlo_again(self, rec: CallRecord) -> None:
        """Monte Carlo samples of a call that was calibrated in a higher precision: a parameter it contributes to
        shares a call that could not be."""
        _, low_site, _ = self._calibration_sites()
        primary = self._run(rec, self._primary_site(explicit=True)) if self._rerun_primary(low_site) else None
        low = primary if low_site is None else self._run(rec, low_site)
        self._monte_carlo(rec, low_site, low, self._reference_run(rec, primary))
        self.source.clear()

    def _sampled_value(self, name: str, row: JudgedRow) -> None:
        """A summed value's Monte Carlo noise: the spread of the summed samples around the summed base runs."""
        base = self._sums.get("mc_base", name)
        samples = [self._sums.get(f"mc{k}", name) for k in range(SAMPLES)]
        if base is None or any(s is None for s in samples):
            return
        row.noise_target = spread(base, samples)
        ref_base = self._sums.get("mc_ref_base", name)
        refs = [self._sums.get(f"mc_ref{k}", name) for k in range(SAMPLES)]
        if ref_base is not None and all(r is not None for r in refs):
            row.noise_reference = spread(ref_base, refs)
        else:
            row.noise_reference = self._reference_default(row.noise_target)
        row.calibration = f"{self.where}:{MONTE_CARLO}"


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
        if _roundoff(ref_dtype, ref_amp, self.ref_reduced) < _roundoff(dtype_name(self.dtype), self.amp,
                                                                        self.reduced):
            return None
        return Site("reference", _CPU, live=False, cast="source", autocast=ref_amp, params="reference",
                    trusted=True, reduced=tuple(sorted(self.ref_reduced.items())))

    def _buffer_rows(self) -> None:
        """One row per buffer a single call updated (BatchNorm's running statistics) against its state_after."""
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


def _roundoff(dtype: str, amp, modes: dict[str, str]) -> float:
    """The unit roundoff a run computes in: its dtype's or autocast's, or its reduced float32 modes' (TF32: 2^-11)."""
    base = unit_roundoff(dtype_name(amp or dtype))
    if amp is None and dtype_name(dtype) == "float32" and modes:
        base = max(base, *(2.0 ** -(MANTISSA_BITS[m] + 1) for m in modes.values()))
    return base


def _amp_dtype(text):
    """The torch dtype of a recorded `amp` setting (None without autocast)."""
    name = amp_dtype_name(text)
    return getattr(torch, name) if name else None


def _source_path(rec: CallRecord, phase: str, name: str) -> tuple[str, tuple[str, str]]:
    """Where the source holds the counterpart of a produced tensor, and whose capture moment orders its row."""
    head, sep, child_name = name.rpartition(":")
    if sep and "@" in head:
        kind = "input" if phase == FORWARD else "grad_output"
        return tensor_path(head, phase, child_name), (head, kind)
    kind = "output" if phase == FORWARD else "grad_input"
    return tensor_path(rec.key, phase, name), (rec.key, kind)


def _rel_all(run: RunResult, high: RunResult) -> dict[tuple[str, str], float]:
    """rel_l2 of every tensor of `run` against the same tensor of the high-precision run."""
    out = {}
    for phase, mine, theirs in ((FORWARD, run.forward, high.forward), (BACKWARD, run.backward, high.backward)):
        for name, value in mine.items():
            if name in theirs:
                out[(phase, name)] = rel_l2(theirs[name], value)
    return out


def _spread(base: RunResult, samples: list[RunResult], scale: float | None = None) -> dict[tuple[str, str], float]:
    """The Monte Carlo noise of every tensor of `base`: `montecarlo.spread` of its perturbed samples (`scale`: its
    SCALE unless given)."""
    out = {}
    for phase, attr in ((FORWARD, "forward"), (BACKWARD, "backward")):
        for name, value in getattr(base, attr).items():
            values = [getattr(s, attr).get(name) for s in samples]
            if all(v is not None for v in values):
                out[(phase, name)] = spread(value, values) if scale is None else spread(value, values, scale)
    return out


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
