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
`param_grad`) and per parameter update (the target's optimizer stepped from the reference's weights and
gradients, phase `optimizer`). A leaf is a call with no children; the model itself is probed like any container,
so functional code in its own `forward` is judged too. A child whose own probe failed is not forced: it runs
live inside its parent, and its computation counts as the parent's.

**Two modes** (who is trusted):
- `teacher_forced` (`record --replay`): the source is the reference file; each call of the target runs again
  on the target's device on the reference's inputs and output gradients; its results are judged against the
  reference's recorded values.
- `against_cpu` (`record --against cpu`): the source is this run's own captured values; after backward, each call
  is recomputed on the CPU in float32 from the target's own inputs, and the target's values are judged against
  that. (Differences in the model's *code* cannot show in this mode: both sides run the same code.)

**Expected noise measures precision, not implementation.** A wrong kernel and a lower precision both make the
local error non-zero; only the first is a bug. The noise of a precision is measured on the *same code* run twice
on the same inputs, once in the run's precision (`low`) and once in a high precision (`high`):
`noise_target = rel_l2(low, high)`. Both runs execute the target's own Python code (a wrapped `forward`, a
patched class, a replaced torch function are in both), so a difference in the code cancels out of the noise and
stays in the local error. `noise_reference` is the same for the reference's precision. Where (`--calibrate`):
- `cpu` (default): both on the CPU, `high` in float64, with the reference's weights. Trusted kernels: a device
  kernel that is wrong only in low precision still shows. `--inject-fault` faults (they stand for device kernels)
  and `--fallback` do not apply there. Cost: two (three if the reference ran in another precision) CPU reruns of
  each calibrated call.
- `device`: `high` on the target device in a higher precision (float32 for bf16/fp16 runs, float64 for float32
  runs); `low` is the probed rerun itself. One extra device rerun per calibrated call; blind to a kernel that is
  wrong only in the low precision.
A call is calibrated only when one of its tensors is off by more than one unit roundoff of its dtype (below
that, nothing can flag it), or when a parameter it contributes to needs it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import (BACKWARD, FORWARD, PARAM_GRADS, ROOT_MODULE, STATE_AFTER, LocalRow, group_path,
                                   tensor_path)
from oneiter.runtime.precision import amp_dtype_name, unit_roundoff
from oneiter.record import trusted
from oneiter.record.capture import CallRecord
from oneiter.record.randomness import RecordedOp
from oneiter.record.rerun import AMBIENT, PROBED, ProbeSkip, Rerunner, RunResult, Site, rel_l2, tensor_stats

__all__ = ["PROBED", "LocalProbe", "MemorySource", "CALIBRATIONS", "make_probe_factory", "reference_precision"]

CALIBRATIONS = ("cpu", "device")
_LATE = 1 << 62  # seq of a row whose moment never came in the real iteration (sorts last in its phase)
_CPU = torch.device("cpu")


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


class LocalProbe:
    """Reruns module calls and measures their local error and expected noise (see the module docstring)."""

    def __init__(self, source, device, *, kind: str, amp=None, dtype=None, calibrate: str = "cpu",
                 ref_precision=None, random_ops: Optional[list[RecordedOp]] = None):
        if calibrate not in CALIBRATIONS:
            raise OneIterError(f"calibrate must be one of {', '.join(CALIBRATIONS)}, got '{calibrate}'")
        self.source = _Cached(source)
        self.device = torch.device(device)
        self.kind = kind  # teacher_forced | against_cpu
        self.amp = amp  # the run's autocast dtype, or None
        self.dtype = dtype or torch.float32  # the model's storage dtype
        self.run_roundoff = unit_roundoff(_dtype_name(amp or self.dtype))  # of the run's compute precision
        self.calibrate = calibrate
        self.ref_precision = ref_precision  # (dtype name, amp dtype) of the reference when it differs from ours
        self.rows: list[tuple[dict, Any]] = []
        self.unprobed: list[tuple[str, int, str]] = []
        self.num_calls = 0
        self.rerunner = Rerunner(self.source, device, list(random_ops or []), {})
        self.model = None
        self.optimizer = None
        self._deferred: list[CallRecord] = []
        self._sums = _Sums()
        self._contributors: dict[str, list[CallRecord]] = {}
        self._calibrated: set[int] = set()
        self._incomplete: dict[str, str] = {}  # parameter -> why its gradient cannot be judged locally

    @property
    def random_ops(self) -> list[RecordedOp]:
        return self.rerunner.random_ops

    @random_ops.setter
    def random_ops(self, ops: list[RecordedOp]) -> None:
        self.rerunner.random_ops = ops

    def bind(self, model, optimizer=None) -> None:
        """The model being recorded (canonical parameter names) and its optimizer (the `optimizer` rows)."""
        self.model = model
        self.optimizer = optimizer
        names = {id(b): n for n, b in model.named_buffers()}
        names.update({id(p): n for n, p in model.named_parameters()})
        self.rerunner.names = names

    # -- entry points -----------------------------------------------------------------------------------------------
    def after_call(self, rec: CallRecord) -> None:
        """A call returned: probe it now (teacher forced) or after backward (against cpu)."""
        if self.kind == "against_cpu":
            self._deferred.append(rec)
            return
        self._probe(rec)

    def after_backward(self, *, step_later: bool = False) -> None:
        """Backward is over, the optimizer has not stepped: deferred probes, parameter gradients and (unless
        `step_later`: then `before_step` does it) the optimizer."""
        for rec in self._deferred:
            self._probe(rec)
        self._deferred.clear()
        if self.model is not None:
            self._param_rows()
            self._buffer_rows()
            if not step_later:
                self.before_step(grads_changed=False)
        for records in self._contributors.values():
            for rec in records:
                rec.release()
        self._contributors.clear()

    def table(self, seqs: dict[tuple[str, str], int]) -> tuple[list[LocalRow], list[tuple[str, int, str]], dict]:
        """The `/local` rows (capture order filled in from `seqs`), the unprobed calls, and the table's attrs."""
        rows = [LocalRow(seq=at if isinstance(at, int) else seqs.get(at, _LATE), **fields) for fields, at in self.rows]
        attrs = {"kind": self.kind, "calibrate": self.calibrate, "num_calls": self.num_calls,
                 "num_unprobed": len(self.unprobed)}
        return rows, list(self.unprobed), attrs

    # -- module calls -----------------------------------------------------------------------------------------------
    def _probe(self, rec: CallRecord) -> None:
        self.num_calls += 1
        module = rec.path or ROOT_MODULE
        try:
            primary = self._run(rec, self._primary_site())
            judged = self._judge(rec, primary)
            if any(self._needs_noise(f) for f, _ in judged):
                self._calibrate(rec, primary, judged)
        except ProbeSkip as skip:
            rec.status = str(skip)
        except OneIterError as err:
            rec.status = f"rerun refused: {_first_line(err)}"
        except Exception as err:  # the user's code failed in the rerun: this call is not judged, the run goes on
            rec.status = f"rerun failed: {type(err).__name__}: {_first_line(err)}"
        else:
            rec.status = PROBED
            rec.internal = {n: g.to(_CPU) for n, g in primary.internal.items()}
            for fields, at in judged:
                self.rows.append(({"module": module, "call": rec.call, **fields}, at))
            self._sums.add("primary", primary)
            for name in (*primary.param_grads, *primary.buffers):
                self._contributors.setdefault(name, []).append(rec)
        if rec.status != PROBED:
            self.unprobed.append((module, rec.call, rec.status))
        if rec.status != PROBED or not (primary.param_grads or primary.buffers):
            rec.release()
        self.source.clear()

    def _run(self, rec: CallRecord, site: Site) -> RunResult:
        return self.rerunner.run(rec, site, rec.forced())

    def _primary_site(self, explicit: bool = False) -> Site:
        """The rerun whose results are judged (teacher forced: the target's own, inside its forward, so under the
        autocast the forward runs in; `explicit`: outside of it, with the run's autocast set here)."""
        if self.kind == "teacher_forced":
            return Site("target", self.device, live=True, cast="live", autocast=self.amp if explicit else AMBIENT,
                        params="live", trusted=False)
        return Site("cpu32", _CPU, live=False, cast="float32", autocast=None, params="live", trusted=True)

    def _judge(self, rec: CallRecord, run: RunResult) -> list[tuple[dict, tuple[str, str]]]:
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
                judged.append((self._row(phase, name, stored, value), at))
        return judged

    def _row(self, phase: str, tensor: str, stored, value) -> dict:
        """A row's fields: the judged value (the target's) against its reference, noise not yet measured."""
        if self.kind == "teacher_forced":
            stats, dtype = tensor_stats(stored, value), value.dtype
        else:
            stats, dtype = tensor_stats(value, stored), stored.dtype
        return {"phase": phase, "tensor": tensor, "dtype": _dtype_name(dtype), **stats,
                "noise_target": math.nan, "noise_reference": math.nan, "calibration": ""}

    # -- calibration ------------------------------------------------------------------------------------------------
    def _needs_noise(self, fields: dict) -> bool:
        """Whether a row's error could be flagged at all: above one unit roundoff of its dtype and of the run's
        compute precision (under bf16 autocast a float32 gradient is not expected to be closer than bf16's)."""
        return fields["rel_l2"] > max(unit_roundoff(fields["dtype"]), self.run_roundoff)


    def _calibrate(self, rec: CallRecord, primary: RunResult, judged: list) -> None:
        """Measure the expected noise of every judged tensor of this call (and its parameter contributions)."""
        try:
            noise_t, noise_r, where = self._noise(rec, primary)
        except (ProbeSkip, OneIterError):
            raise
        except Exception as err:
            raise ProbeSkip(f"calibration failed: {type(err).__name__}: {_first_line(err)}") from None
        for fields, _ in judged:
            key = (fields["phase"], fields["tensor"])
            if key in noise_t:
                fields["noise_target"] = noise_t[key]
                fields["noise_reference"] = noise_r.get(key, self._reference_default(noise_t[key]))
                fields["calibration"] = where

    def _noise(self, rec: CallRecord, primary: Optional[RunResult]):
        """(noise_target, noise_reference, where) by (phase, name); parameter contributions go into the sums.
        `primary` None: this call's primary rerun is not at hand (calibration after backward) and is redone if
        needed, with the run's autocast set explicitly."""
        high_site, low_site, where = self._calibration_sites()
        high = self._run(rec, high_site)
        if primary is None and (low_site is None or self.kind == "against_cpu"):
            primary = self._run(rec, self._primary_site(explicit=True))
        low = primary if low_site is None else self._run(rec, low_site)
        runs = {"high": high, "low": low}
        noise_t = _rel_all(low, high)
        noise_r: dict = {}
        ref_site = self._reference_site()
        if self.kind == "against_cpu":
            noise_r = _rel_all(primary, high)  # the float32 CPU recomputation is the reference here
            runs["reference"] = primary
        elif ref_site is not None:
            runs["reference"] = self._run(rec, ref_site)
            noise_r = _rel_all(runs["reference"], high)
        if id(rec) not in self._calibrated:
            self._calibrated.add(id(rec))
            for site, run in runs.items():
                self._sums.add(site, run)
        return noise_t, noise_r, where

    def _calibration_sites(self) -> tuple[Site, Optional[Site], str]:
        params = "reference" if self.kind == "teacher_forced" else "live"
        if self.calibrate == "device" and self.kind == "teacher_forced":
            high = Site("high", self.device, live=False, cast=self._higher(), autocast=None, params=params,
                        trusted=False)
            return high, None, "device"
        high = Site("high", _CPU, live=False, cast="float64", autocast=None, params=params, trusted=True)
        low = Site("low", _CPU, live=False, cast="live", autocast=self.amp, params="live", trusted=True)
        return high, low, "cpu"

    def _reference_default(self, noise_target: float) -> float:
        """noise_reference when it was not measured: ours (same precision), or 0 (a finer reference precision)."""
        return noise_target if self.ref_precision is None else 0.0

    def _higher(self) -> str:
        low = self.amp is not None or self.dtype in (torch.bfloat16, torch.float16)
        return "float32" if low else "float64"

    def _reference_site(self) -> Optional[Site]:
        """The reference's own precision on the CPU, when it is not finer than the target's. Equal: its noise is
        ours; finer (a float32 reference for a bf16 target): negligible next to ours, not measured."""
        if self.kind != "teacher_forced" or self.ref_precision is None:
            return None
        ref_dtype, ref_amp = self.ref_precision
        if unit_roundoff(_dtype_name(ref_amp or ref_dtype)) < self.run_roundoff:
            return None
        return Site("reference", _CPU, live=False, cast="source", autocast=self.ref_precision[1],
                    params="reference", trusted=True)

    # -- parameter gradients ----------------------------------------------------------------------------------------
    def _param_rows(self) -> None:
        """One row per parameter gradient: the sum of every call's own contribution, judged like any tensor."""
        if _world_size() > 1:  # DDP averages gradients over ranks; one rank's own contributions cannot match
            return
        for index, (name, param) in enumerate(self.model.named_parameters()):
            records = self._contributors.get(name)
            judged = self._sums.get("primary", name)
            if not records or judged is None:
                continue
            stored = self._stored_grad(name, param)
            if stored is None or tuple(stored.shape) != tuple(judged.shape):
                continue
            fields = self._row("param_grad", _leaf(name), stored, judged.to(stored.dtype if self.kind ==
                               "against_cpu" else param.dtype))
            if self._needs_noise(fields):
                self._param_noise(name, records, fields)
            self.rows.append(({"module": _owner(name), "call": 0, **fields}, index))

    def _buffer_rows(self) -> None:
        """One row per buffer a single call updated (BatchNorm's running statistics) against its state_after."""
        names = [n for n, _ in self.model.named_buffers()]
        for index, name in enumerate(names):
            records = self._contributors.get(name)
            judged = self._sums.get("primary", name)
            path = group_path(STATE_AFTER, name)
            if not records or judged is None or len(records) != 1 or self.kind != "teacher_forced":
                continue
            if not self.source.has(path) or tuple(self.source.tensor(path).shape) != tuple(judged.shape):
                continue
            fields = self._row("optimizer", _leaf(name), self.source.tensor(path), judged)
            if self._needs_noise(fields) and judged.is_floating_point():
                self._calibrated_value(name, records, fields, summed=False)
            self.rows.append(({"module": _owner(name), "call": 0, **fields}, (1 << 40) + index))

    def _stored_grad(self, name: str, param):
        """The gradient the judged sum is compared with: the reference's (teacher forced) or this run's .grad."""
        if self.kind == "teacher_forced":
            path = group_path(PARAM_GRADS, name)
            return self.source.uncached(path) if self.source.has(path) else None
        return None if param.grad is None else param.grad.detach().to(_CPU)

    def _param_noise(self, name: str, records: list[CallRecord], fields: dict) -> None:
        self._calibrated_value(name, records, fields, summed=True)

    def _calibrated_value(self, name: str, records: list[CallRecord], fields: dict, summed: bool) -> None:
        """Noise of a parameter gradient (summed over calls) or of a buffer's update, calibrating calls as needed."""
        for rec in records:
            if id(rec) not in self._calibrated:
                try:
                    self._noise(rec, None)
                    self.source.clear()
                except Exception as err:
                    fields["calibration"] = f"failed: {type(err).__name__}: {_first_line(err)}"[:200]
                    return
        high, low = self._sums.get("high", name), self._sums.get("low" if self.calibrate == "cpu" or
                                                                   self.kind != "teacher_forced" else "primary", name)
        if high is None or low is None:
            return
        fields["noise_target"] = rel_l2(high, low)
        ref = self._sums.get("reference", name)
        fields["noise_reference"] = rel_l2(high, ref) if ref is not None else self._reference_default(
            fields["noise_target"])
        fields["calibration"] = "cpu" if self.calibrate == "cpu" or self.kind != "teacher_forced" else "device"

    # -- the optimizer step -----------------------------------------------------------------------------------------
    def before_step(self, *, grads_changed: bool) -> None:
        """The optimizer is about to step. `grads_changed`: code between backward and the step changed the
        gradients in place (clipping, unscaling), which the recording does not hold: the update is not judged."""
        if self.model is None or self.optimizer is None or self.kind != "teacher_forced":
            return
        if grads_changed:
            self.unprobed.append(("(optimizer)", 0, "the gradients changed between backward and the step (gradient "
                                  "clipping or unscaling), which a recording does not hold"))
            return
        self._optimizer_rows()

    def _optimizer_rows(self) -> None:
        """The target's optimizer, stepped from the reference's weights and gradients, against its state_after."""
        opt = self.optimizer
        if any(len(state) for state in opt.state.values()):
            self.unprobed.append(("(optimizer)", 0, "the optimizer has state from earlier iterations, which a "
                                  "recording does not hold"))
            return
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = {n: i for i, n in enumerate(names.values())}
        rows = []
        for chunk in _step_chunks(opt):
            try:
                judged = _step(opt, names, self.rerunner, self._optimizer_site("target"), chunk)
            except Exception as err:
                self.unprobed.append(("(optimizer)", 0,
                                      f"could not be rerun: {type(err).__name__}: {_first_line(err)}"))
                return
            mine = []
            for name, after in judged.items():
                wide = torch.promote_types(after.dtype, torch.float32)  # nearby floats subtract exactly there
                delta = self._reference_delta(name, wide)
                if delta is None:
                    continue
                before = self.rerunner.reference_state(name).to(_CPU, wide)
                fields = self._row("optimizer", _leaf(name), delta, after.to(_CPU, wide) - before)
                fields["dtype"] = _dtype_name(after.dtype)
                mine.append((name, fields))
            del judged
            if any(self._needs_noise(f) for _, f in mine):
                self._optimizer_noise(opt, names, mine, chunk)
            rows.extend(mine)
        for name, fields in rows:
            self.rows.append(({"module": _owner(name), "call": 0, **fields}, order.get(name, _LATE)))

    def _optimizer_site(self, name: str) -> Site:
        if name == "target":
            return Site("target", self.device, live=True, cast="live", autocast=None, params="reference",
                        trusted=False)
        if name == "high":
            return Site("high", _CPU, live=False, cast="float64", autocast=None, params="reference", trusted=True)
        if name == "low":
            return Site("low", _CPU, live=False, cast="live", autocast=None, params="reference", trusted=True)
        return Site("reference", _CPU, live=False, cast="source", autocast=None, params="reference", trusted=True)

    def _optimizer_noise(self, opt, names: dict, rows: list, chunk: set[int] | None) -> None:
        try:
            steps = {s: _step(opt, names, self.rerunner, self._optimizer_site(s), chunk)
                     for s in ("high", "low", "reference")}
        except Exception as err:
            for _, fields in rows:
                fields["calibration"] = f"failed: {type(err).__name__}: {_first_line(err)}"[:200]
            return
        for name, fields in rows:
            before = self.rerunner.reference_state(name).to(_CPU, torch.float64)
            deltas = {s: steps[s][name].to(_CPU, torch.float64) - before for s in steps}
            fields["noise_target"] = rel_l2(deltas["high"], deltas["low"])
            fields["noise_reference"] = rel_l2(deltas["high"], deltas["reference"])
            fields["calibration"] = "cpu"

    def _reference_delta(self, name: str, wide):
        """The reference's update of a parameter, computed in `wide` or the reference's wider dtype."""
        before = self.rerunner.reference_state(name)
        path = group_path(STATE_AFTER, name)
        if before is None or not self.source.has(path):
            return None
        after = self.source.uncached(path)
        wide = torch.promote_types(wide, torch.promote_types(after.dtype, before.dtype))
        return after.to(wide) - before.to(wide)


# torch's optimizers whose step updates each parameter from its own gradient and state only: a copy of one over a
# few of the parameters steps them exactly as over all of them (single-tensor, foreach and fused alike)
_PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop",
                  "Rprop")
_STEP_BYTES = 64 << 20  # parameters per shadow step of such an optimizer


def _step_chunks(opt) -> list[set[int] | None]:
    """The parameters (by id) of each shadow step: for torch's per-parameter optimizers, chunks of about
    `_STEP_BYTES` (the copies of weights, gradients and optimizer state of a chunk are freed before the next, so a
    7B model's optimizer rows need a chunk's memory, not a second copy of the model and its state); for any other
    optimizer (LBFGS, one of the user's, a subclass: its step may couple parameters) one step over all (None)."""
    import torch.optim

    kind = type(opt)
    if kind.__name__ not in _PER_PARAMETER or getattr(torch.optim, kind.__name__, None) is not kind:
        return [None]
    chunks: list[set[int]] = [set()]
    size = 0
    for group in opt.param_groups:
        for p in group["params"]:
            nbytes = p.numel() * p.element_size()
            if chunks[-1] and size + nbytes > _STEP_BYTES:
                chunks.append(set())
                size = 0
            chunks[-1].add(id(p))
            size += nbytes
    return chunks


def _step(opt, names: dict, rerunner: Rerunner, site: Site, chunk: set[int] | None = None) -> dict:
    """A copy of `opt` over fresh tensors holding the reference's weights and gradients (of the parameters in
    `chunk`, or all), stepped once at `site`; returns the updated weights by canonical name."""
    groups, tensors = [], {}
    for group in opt.param_groups:
        params = []
        for p in group["params"]:
            if chunk is not None and id(p) not in chunk:
                continue
            name = names.get(id(p))
            before = rerunner.reference_state(name) if name else None
            grad_path = group_path(PARAM_GRADS, name)
            if before is None:
                raise ProbeSkip(f"the reference has no state_before for a parameter of the optimizer ({name})")
            dtype = site.dtype_for(p.dtype, before.dtype)
            device = p.device if site.live else site.device
            q = before.to(device, dtype, copy=True)
            if rerunner.source.has(grad_path):
                source = rerunner.source  # the probe's _Cached: a fresh read is ours, a remembered one is shared
                q.grad = source.uncached(grad_path).to(device, dtype, copy=source.cached(grad_path))
            params.append(q)
            tensors[name] = q
        if not params:
            continue
        options = {k: v for k, v in group.items() if k != "params"}
        if not site.live:
            options.update({k: False for k in ("foreach", "fused", "capturable") if options.get(k)})
        groups.append({"params": params, **options})
    shadow = type(opt)(groups, **({"lr": groups[0]["lr"]} if groups and "lr" in groups[0] else {}))
    with torch.no_grad(), trusted.running(site.trusted):
        shadow.step()
    return {name: t.detach() for name, t in tensors.items()}


def make_probe_factory(kind: str, ref, device, *, amp=None, dtype=None, calibrate: str = "cpu"):
    """A `RecordingSession` probe factory: teacher forced against the open reference `ref`, or against cpu."""
    from oneiter.record.randomness import recorded_random_ops

    if calibrate not in CALIBRATIONS:
        raise OneIterError(f"--calibrate must be one of {', '.join(CALIBRATIONS)}, got '{calibrate}'")

    def factory(sink):
        if kind == "against_cpu":
            return LocalProbe(MemorySource(sink.keep), device, kind=kind, amp=amp, dtype=dtype, calibrate=calibrate)
        return LocalProbe(ref, device, kind=kind, amp=amp, dtype=dtype, calibrate=calibrate,
                          ref_precision=reference_precision(ref.meta, amp, dtype),
                          random_ops=recorded_random_ops(ref))

    return factory


def reference_precision(meta: dict, amp, dtype):
    """(storage dtype name, autocast dtype) of the reference when it differs from the target's, else None."""
    ref_dtype = str(meta.get("dtype") or "float32")
    ref_amp = _amp_dtype(meta.get("amp"))
    mine = (_dtype_name(dtype or torch.float32), amp)
    return None if (ref_dtype, ref_amp) == mine else (ref_dtype, ref_amp)


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


def _owner(name: str) -> str:
    return name.rpartition(".")[0] or ROOT_MODULE


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
