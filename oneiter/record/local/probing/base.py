"""`LocalProbe`: reruns module calls and measures their local error and expected noise (the module docstring of
`probe.py` is its manual).

Where this sits: the top floor, over `SummedValues` (`summed_rows.py`) <- `Calibration` (`calibration.py`) <-
`NoiseBounds` (`bounds.py`) <- `ProbeState` (`state.py`). Here: the entry points the capture and the recorder call
(`after_call`, `after_backward`, `before_step`, `after_step`, `table`), and each module call's probe. The two modes
are in `probe.py`."""

from __future__ import annotations

import json

import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import (
    BACKWARD,
    FOREIGN_KERNELS,
    FORWARD,
    ROOT_MODULE,
    UNBOUNDED,
    LocalRow,
    tensor_path,
)
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.probing.summed_rows import SummedValues
from oneiter.record.local.rerun import PROBED, ProbeSkip, RunResult
from oneiter.record.local.rows import JudgedRow, first_line
from oneiter.record.modes import trusted
from oneiter.runtime import kernels
from oneiter.runtime.names import tensor_names

__all__ = ["LocalProbe"]

_CPU = torch.device("cpu")
_LISTED = 20  # the device's ops whose kernels are not torch's own, listed in /local's FOREIGN_KERNELS at most


class LocalProbe(SummedValues):
    """Reruns module calls and measures their local error and expected noise (`probe.py`'s module docstring).

    What both modes share lives here and in the floors below (`probing/`'s map); what differs (who is trusted,
    where the primary rerun runs, which parameters the calibration uses, what a parameter gradient is judged
    against) is in `TeacherForcedProbe` and `AgainstCpuProbe`."""

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
            checks = getattr(self, "backward_checks", None)  # the teacher-forced probe's (`probe.py`)
            if checks is not None:
                checks.forget(module, earlier.call)
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

    def _buffer_rows(self) -> None:  # noqa: B027 - a hook: a no-op unless a mode overrides it
        """Rows for buffers a call updated: only where the source holds their state_after (teacher forced)."""

    def _check(self, rec: CallRecord, primary: RunResult) -> None:  # noqa: B027 - a hook
        """Raise ProbeSkip when the rerun does not reproduce the live call (`fidelity.py`; teacher forced)."""

    def after_step(self) -> None:  # noqa: B027 - a hook: a no-op unless a mode overrides it
        """The optimizer has stepped (state_after is taken): check the shadow step against it (teacher forced)."""

    # -- module calls -----------------------------------------------------------------------------------------------
    def _probe(self, rec: CallRecord) -> None:
        self.num_calls += 1
        module = rec.path or ROOT_MODULE
        try:
            primary = self._run(rec, self._primary_site())
            self._check(rec, primary)
            judged = self._judge(rec, primary)
            self._expect(rec, primary, judged)
        except ProbeSkip as skip:
            rec.status = str(skip)
        except OneIterError as err:
            rec.status = f"rerun refused: {first_line(err)}"
        except Exception as err:  # the user's code failed in the rerun: this call is not judged, the run goes on
            rec.status = f"rerun failed: {type(err).__name__}: {first_line(err)}"
        else:
            rec.status = PROBED
            rec.internal = {n: g.to(_CPU) for n, g in primary.internal_grads.items()}
            self.rows.extend(judged)
            self._sums.add("primary", primary)
            for name in (*primary.grad_contributions, *primary.changed_buffers):
                self._contributors.setdefault(name, []).append(rec)
        live, rec.live_collectives = rec.live_collectives, {}
        if rec.status != PROBED:
            self.unprobed.append((module, rec.call, rec.status))
            if rec.parent is not None:  # it runs live in its caller's rerun: so do its collectives
                rec.parent.live_collectives.update(live)
        if rec.status != PROBED or not (primary.grad_contributions or primary.changed_buffers):
            rec.release()
        self.source.clear()

    def _expect(self, rec: CallRecord, primary: RunResult, judged: list[JudgedRow]) -> None:
        """What the call's rows are expected to differ by: a call that runs a low-precision recipe is judged against
        the recipe's exact emulation (`recipe_rows.py`), never by reruns in float64; any other is calibrated when
        one of its rows could be flagged at all."""
        recipe = self.recipes.recipe(rec)
        if recipe is not None:
            self.recipes.judge(rec, recipe, primary, judged, self.source, self.rerunner, self.amp, self._sides)
        elif any(row.needs_noise(self.run_roundoff) for row in judged):
            self._calibrate(rec, primary, judged)

    def _judge(self, rec: CallRecord, run: RunResult) -> list[JudgedRow]:
        """One row per produced tensor (values that merely pass on a forced/given tensor are skipped)."""
        judged = []
        for phase, produced in ((FORWARD, run.forward), (BACKWARD, run.backward)):
            for name, value in produced.items():
                if (phase, name) in run.passed_on:
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


def _source_path(rec: CallRecord, phase: str, name: str) -> tuple[str, tuple[str, str]]:
    """Where the source holds the counterpart of a produced tensor, and whose capture moment orders its row."""
    head, sep, child_name = name.rpartition(":")
    if sep and "@" in head:
        kind = "input" if phase == FORWARD else "grad_output"
        return tensor_path(head, phase, child_name), (head, kind)
    kind = "output" if phase == FORWARD else "grad_input"
    return tensor_path(rec.key, phase, name), (rec.key, kind)
