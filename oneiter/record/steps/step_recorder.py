"""Several consecutive iterations of one run in one file: `oneiter record --steps N`, `oneiter.StepRecorder`.

Where this sits: each iteration is recorded by an `oneiter.Recorder` of its own at the statistics level (`level=
"stats"`: every tensor's statistics and checksum, the batch and random values in full, and for the first step the
weights, buffers and optimizer state in full: where a replay starts), into a temporary file that is copied into
the output under `/steps/<step>/` as soon as the step ends (docs/format.md). While each step runs, `StepMetrics`
measures its signature row (`format/signature.py`: the loss, each parameter's gradient and update norm); the rows are
the table `/signature`.

A replay of a multi-step reference (`replay=`) starts from the reference's first step (weights, buffers,
optimizer state, bit for bit) and then runs on its own, fed the reference's batch and random values step by step;
with `run(fn)` each step is also run by the perturbed twin (`record/steps/twin.py`, kept as `/twin_signature`): how far
it drifts from the target is the band a precision change explains.
`judge/stepwise/step_compare.py` compares two such files step by step.

    with oneiter.StepRecorder(model, "ref.h5", optimizer=opt, steps=12) as rec:
        rec.run(one_step)                   # one_step(step): the loop's body, calling rec.inputs(...) for its batch

`step(s)` records one iteration with a block instead (what the Hugging Face callback and the mmengine hook do for
every K-th step: no twin there, since the step cannot be run again).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from oneiter.errors import OneIterError
from oneiter.format.file_writer import impact_dataset
from oneiter.format.layout import IterationFile
from oneiter.format.schema import PRECISION_MODES, SIGNATURE, STEPS, TWIN_SIGNATURE
from oneiter.format.signature import signature_columns
from oneiter.record.capture.optimizer_step import before_update
from oneiter.record.impact.candidates import judged_in
from oneiter.record.impact.fixed_call import FIXED
from oneiter.record.impact.runs import Impact, measure, one_pass
from oneiter.record.impact.start import Start
from oneiter.record.options import RecordOptions
from oneiter.record.recorder import Recorder, RecordSummary, model_of, optimizer_list
from oneiter.record.session import atomic_output, check_output
from oneiter.record.steps.twin import Twin, TwinPass
from oneiter.runtime import precision_modes
from oneiter.runtime.distributed import current_rank, rank_path, replay_path
from oneiter.runtime.names import parameters
from oneiter.runtime.precision import amp_dtype_name, unit_roundoff
from oneiter.runtime.sharding import shard_of

__all__ = ["StepRecorder", "StepMetrics", "check_steps", "TWIN_ATTRS"]

TWIN_ROUNDOFF, TWIN_CHECK = "twin_roundoff", "twin_check"
TWIN_ATTRS = (TWIN_ROUNDOFF, TWIN_CHECK)


def check_steps(steps: Any, param: str = "steps") -> list[int]:
    """`steps` as the list of iteration numbers to record: an int N (0..N-1, N >= 1) or increasing numbers >= 0."""
    if isinstance(steps, bool) or not isinstance(steps, (int, list, tuple, range)):
        raise OneIterError(f"{param} must be a number of steps (an int >= 1), got {steps!r}", param=param)
    if isinstance(steps, int):
        if steps < 1:
            raise OneIterError(f"{param} must be at least 1, got {steps}", param=param)
        return list(range(steps))
    numbers = list(steps)
    if not numbers or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in numbers) or \
            numbers != sorted(set(numbers)):
        raise OneIterError(f"{param} must be increasing step numbers >= 0, got {steps!r}", param=param)
    return numbers


class StepMetrics:
    """One step's signature row, measured as it runs: gradient norms at the first optimizer step (after whatever
    the loop did to the gradients between backward and the step: clipping, unscaling), update norms when the
    block ends (a copy of the weights is taken at that step and freed after). All in float64."""

    def __init__(self, model, optimizers):
        self.params = [p for _, p in model.named_parameters()]
        self.optimizers = list(optimizers)
        self.grads: list[float] | None = None
        self._before: list | None = None
        self._handles: list = []

    def __enter__(self) -> "StepMetrics":
        self._handles = [before_update(opt, self._pre) for opt in self.optimizers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self) -> None:
        if self.grads is None:
            self.grads = _norms([p.grad for p in self.params])
            self._before = [shard_of(p.detach()).clone() for p in self.params]

    def row(self, loss: float) -> np.ndarray:
        """[loss, gradient norms..., update norms...] of the step that just ended."""
        import torch

        grads = self.grads if self.grads is not None else _norms([p.grad for p in self.params])
        if self._before is None:
            updates = [0.0] * len(self.params)
        else:
            with torch.no_grad():
                updates = _norms([shard_of(p.detach()) - b for p, b in zip(self.params, self._before, strict=True)])
        self._before = None
        return np.array([loss, *grads, *updates], dtype=np.float64)


def _norms(tensors) -> list[float]:
    """Each tensor's float64 norm; of a DTensor its shard's (a rank's file holds its shard: no collective runs)."""
    import torch

    tensors = [None if t is None else shard_of(t.detach()) for t in tensors]
    values = [torch.linalg.vector_norm(t, dtype=torch.float64) if t is not None and t.numel() else None
              for t in tensors]
    return [0.0 if v is None else float(v) for v in values]


class StepRecorder:
    """Record iterations `steps` of `model`, run inside the `with` block, into the multi-step file `out`.

    Args:
        model, out, optimizer, progress, notify: as for `oneiter.Recorder`.
        steps: the iterations to record: N (0..N-1) or increasing step numbers; with `replay=` of a multi-step
            recording, the first of its steps (default: all of them).
        twin: when replaying, run each step of `run()` again by the perturbed twin (the band: docs/steps.md).
        impact, impact_top, impact_from: when replaying, with `run()`: every step run again from the first one's
            start per call the one-iteration replay `impact_from` flags, that call fixed at every step, ranked by the
            loss gap at the last step (docs/impact.md).
        **options: `oneiter.Recorder`'s keywords (`replay`, `amp`, `seed`, `include`, ...), checked as for one
            iteration; the level is always "stats".

    `rec.run(fn)` calls `fn(step)` for each step (the module docstring); `with rec.step(s):` records one step
    with a block instead. `inputs`, `loss` and `note` act on the step being recorded. `StepRecorder.from_options`
    takes a `RecordOptions` built beforehand (what `record()` and the integrations use).
    """

    def __init__(self, model, out: str | os.PathLike, *, steps: Any = None, optimizer=None,
                 progress: Callable[[str, int], None] | None = None, notify: Callable[[str], None] | None = None,
                 twin: bool = True, **options: Any):
        opts = RecordOptions(out=out, **options)  # type: ignore[arg-type]  # `out` checked, made a Path there
        Recorder.from_options(model, opts, optimizer=optimizer)  # the model and options checked as for one iteration
        self._setup(model, opts, steps, optimizer, progress, notify, twin)

    @classmethod
    def from_options(cls, model, options: RecordOptions, steps: Any = None, *, optimizer=None,
                     progress: Callable[[str, int], None] | None = None, notify: Callable[[str], None] | None = None,
                     twin: bool = True) -> "StepRecorder":
        """A StepRecorder of `options` (`RecordOptions`, built and so checked beforehand)."""
        recorder = cls.__new__(cls)
        recorder._setup(model, options, steps, optimizer, progress, notify, twin)
        return recorder

    def _setup(self, model, options: RecordOptions, steps: Any, optimizer, progress, notify, twin: bool) -> None:
        if options.against:
            raise OneIterError("against='cpu' judges one iteration: record several steps against a reference "
                               "(replay=) instead", param="against")
        if options.compile:
            raise OneIterError("compile records one iteration: for several steps of a compiled model, compile it in "
                               "the training code (torch.compile) or record one step (--step)", param="compile")
        info = current_rank()
        if info.distributed:  # under torchrun each rank writes (and replays) its own file, as for one iteration
            options = replace(options, out=rank_path(options.out, info.rank, info.world_size),
                              replay=replay_path(options.replay, info) if options.replay is not None else None)
        if options.impact and options.impact_from is None:
            raise OneIterError("impact over several steps fixes at every step the calls a replay of one of them "
                               "flags: give impact_from, a replay of one iteration recorded in full (the --step S "
                               "replay the steps' comparison prints)", param="impact")
        self.impact = (options.impact_from, options.impact_top) if options.impact else None
        self._impact_start: Start | None = None
        self.impact_runs, self.impact_seconds, self._impact_done = 0, 0.0, False
        self.model, self.options = model, replace(options, level="stats", impact=False, impact_top=None,
                                                  impact_from=None)
        self.optimizers = optimizer_list(optimizer)
        self.progress, self.notify, self.twin_enabled = progress, notify, bool(twin)
        self.wanted = None if steps is None else check_steps(steps)
        self.summary: RecordSummary | None = None
        self.ref: IterationFile | None = None
        self._stack: ExitStack | None = None
        self._current: Recorder | TwinPass | None = None
        self._rows: list[np.ndarray] = []
        self._twin_rows: list[np.ndarray] = []
        self._done: list[int] = []
        self._twin: Twin | None = None
        self.twin_check = math.nan

    # -- the block ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> "StepRecorder":
        import h5py

        opts = self.options
        check_output(opts.out, opts.force)
        stack = ExitStack()
        try:
            if opts.replay is not None:
                self.ref = stack.enter_context(IterationFile(opts.replay))
                self.steps = self._replayed_steps()
            elif self.wanted is None:
                raise OneIterError("steps must be given (how many iterations to record)", param="steps")
            else:
                self.steps = self.wanted
            tmp = stack.enter_context(atomic_output(opts.out, opts.force))
            self._file = stack.enter_context(h5py.File(tmp, "w", libver="latest"))
            self._file.create_group(STEPS)
            self._tmp_step = tmp.with_name(tmp.name + ".step")
            stack.callback(self._remove_step_file)
        except BaseException:
            stack.close()
            raise
        self._stack, self._started = stack, time.perf_counter()
        return self

    @property
    def _reference(self) -> IterationFile:
        """The reference a replay runs (only a replay's paths ask for it: `__enter__` opened it)."""
        assert self.ref is not None
        return self.ref

    def _replayed_steps(self) -> list[int]:
        ref = self._reference
        theirs = ref.steps()
        if not theirs:
            raise OneIterError(f"replay '{ref.path.name}' records one iteration, not several: replay it without "
                               f"steps=", param="steps")
        if self.wanted is None:
            return theirs
        if self.wanted != theirs[:len(self.wanted)]:
            raise OneIterError(f"steps {_shown(self.wanted)} are not the first steps of the reference "
                               f"'{ref.path.name}' ({_shown(theirs)}): a replay runs the reference's steps from "
                               f"its first", param="steps")
        return self.wanted

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        if exc_type is not None:
            stack.__exit__(exc_type, exc, tb)
            return
        with stack:
            if not self._done:
                raise OneIterError("no step was recorded: call rec.run(fn) or record each step in `with rec.step(s)`",
                                   param="steps")
            if self.impact is not None and not self._impact_done:
                raise OneIterError("impact runs every step again: give the loop's body as a function, rec.run(fn)",
                                   param="impact")
            self._finish()
        path = self.options.out
        self.summary = RecordSummary(path, self._num_entries, 0, path.stat().st_size,
                                     time.perf_counter() - self._started, float(self._rows[-1][0]),
                                     self._num_calls, num_steps=len(self._done), impact_runs=self.impact_runs,
                                     impact_seconds=self.impact_seconds)

    def _finish(self) -> None:
        """The signature tables and the root attributes; the file is renamed into place when the block closes."""
        first = self._file[STEPS][str(self._done[0])]
        # the names state_before holds: those of the module the recording names (inside DDP's wrapper, `model_of`)
        columns = signature_columns([n for n, _ in parameters(model_of(self.model))])
        tables = [(SIGNATURE, self._rows), (TWIN_SIGNATURE, self._twin_rows)]
        tables = [(name, rows) for name, rows in tables if rows]
        for name, rows in tables:
            self._file.create_dataset(name, data=np.stack(rows)).attrs["columns"] = np.array(
                columns, dtype=__import__("h5py").string_dtype())
        attrs = {k: v for k, v in first.attrs.items() if k not in ("iteration", "complete")}
        attrs.update({"steps": len(self._done), "loss": float(self._rows[-1][0]), "level": "stats", "local": ""})
        if self._twin_rows:
            assert self._twin is not None  # its rows come from it
            attrs.update({TWIN_ROUNDOFF: self._twin.roundoff, TWIN_CHECK: float(self.twin_check)})
        self._file.attrs.update(attrs)
        self._num_calls = int(first.attrs.get("num_calls", 0))
        self._file.attrs["complete"] = True
        self._file.close()

    # -- recording one step -------------------------------------------------------------------------------------------
    @property
    def next_step(self) -> int | None:
        """The next step to record (None: all are recorded, or the block has not started)."""
        if self._stack is None or len(self._done) >= len(self.steps):
            return None
        return self.steps[len(self._done)]

    @contextmanager
    def step(self, step: int) -> Iterator[Recorder]:
        """Record iteration `step` (the next one of `steps`) with the block: yields its `Recorder`."""
        if self._stack is None:
            raise OneIterError("rec.step() works only inside `with StepRecorder(...) as rec:`", param="steps")
        index = len(self._done)
        if index >= len(self.steps) or self.steps[index] != step:
            expected = self.steps[index] if index < len(self.steps) else "none (all were recorded)"
            raise OneIterError(f"step {step} is not the next step to record (expected {expected})", param="steps")
        first = index == 0
        opts = replace(self.options, out=self._tmp_step, force=True, seed=self.options.seed if first else None,
                       meta={**self.options.meta, "iteration": step})
        recorder = Recorder.from_options(self.model, opts, optimizer=self.optimizers, progress=None,
                                         notify=self.notify if first else None,
                                         reference=self.ref.step(step) if self.ref is not None else None, start=first,
                                         step_of=True)
        metrics = StepMetrics(self.model, self.optimizers)
        with metrics, recorder:
            if first and self.ref is not None and self.twin_enabled:
                self._twin = Twin(self.model, self.optimizers, self._roundoff(), seed=self.options.seed or 0)
            if first and self.impact is not None:  # where every impact run starts (`record/impact/start.py`)
                self._impact_start = Start(self.model, self.optimizers)
            self._current = recorder
            try:
                yield recorder
            finally:
                self._current = None
        summary = recorder.summary
        assert summary is not None  # the block ended without an error: the step's file is written
        self._rows.append(metrics.row(summary.loss))
        self._num_entries = summary.num_entries
        self._keep(step)
        if self.progress is not None:
            self.progress(f"step {index + 1}/{len(self.steps)}", len(self._done))

    def _keep(self, step: int) -> None:
        """Copy the step's file into `/steps/<step>` (attributes, hard links and all) and delete it."""
        import h5py

        with h5py.File(self._tmp_step, "r") as source:
            self._file.copy(source["/"], self._file[STEPS], str(step))
        self._remove_step_file()
        self._done.append(step)

    def _remove_step_file(self) -> None:
        if self._tmp_step.exists():
            os.unlink(self._tmp_step)

    def run(self, fn: Callable[[int], Any]) -> None:
        """Record every step: `fn(step)` runs the loop's body (its batch through `rec.inputs(...)`). Replaying, the
        twin then runs the same step (`fn` is called again, on the twin's weights: keep other side effects out)."""
        for index, step in enumerate(self.steps[len(self._done):], start=len(self._done)):
            with self.step(step):
                fn(step)
            if self._twin is None:
                continue
            if index == 0:  # the twin is a model of the run: unperturbed, it must give the run's own step
                check = self._twin_step(self._twin.copy(), step, fn, perturb=False)
                self.twin_check = _distance(check, self._rows[-1])
            self._twin_rows.append(self._twin_step(self._twin, step, fn, perturb=True))
        if self.impact is not None and len(self._done) == len(self.steps):
            self._measure_impact(fn)
            self._impact_start = None  # a copy of the first step's start: not kept past the runs

    def _measure_impact(self, fn) -> None:
        """`impact`: every step run again from the first one's start per call `impact_from` flags, that call fixed
        at every step (`record/impact/runs.py`); ranked by the gaps at the last step. Its table goes into the file."""
        assert self.impact is not None and self._impact_start is not None  # `impact`: the first step kept its start
        source, top = self.impact
        judged, run_dtype = judged_in(source)
        progress = self.progress
        job = Impact(self._impact_start, lambda targets, **how: self._impact_steps(targets, fn, **how),
                     float(self._rows[-1][0]), self._device().type,
                     (lambda text: progress(text, len(self._done))) if progress else None, step=self.steps[-1],
                     roundoff=self._roundoff())
        rows, attrs = measure(job, judged, run_dtype, top)
        impact_dataset(self._file, rows, {**attrs, "impact_from": str(source)})
        self.impact_runs, self.impact_seconds = len(rows), float(attrs.get("seconds", 0.0))
        self._impact_done = True

    def _impact_steps(self, targets, fn, **how):
        """Every step once more, `targets` fixed at each (or the weights perturbed by one rounding `perturb` at each):
        the last step's gaps, and per target whether it was fixed (at every step: else the first reason it was
        not). `how`: `one_pass`'s keywords (`perturb`, `expected`)."""
        done: dict = {}
        gaps = None
        for step in self.steps:
            def run(step_pass, step=step):
                self._current = step_pass
                try:
                    fn(step)
                finally:
                    self._current = None

            gaps, mine = one_pass(self.model, self._reference.step(step), self.options, self._device(), targets, run,
                                  optimizers=self.optimizers, **how)
            for key, why in mine.items():
                if done.get(key, FIXED) == FIXED:
                    done[key] = why
        return gaps, done

    def _twin_step(self, twin: Twin, step: int, fn, *, perturb: bool) -> np.ndarray:
        view = self._reference.step(step)
        metrics = StepMetrics(self.model, self.optimizers)
        twin_pass = TwinPass(self.model, view, self.options, self._device())
        with twin.swapped_in(step, perturb=perturb), metrics, twin_pass:
            self._current = twin_pass
            try:
                fn(step)
            finally:
                self._current = None
            return metrics.row(twin_pass.loss_value())  # its weights still in: their update is the twin's

    def _device(self):
        import torch

        for tensor in (*self.model.parameters(), *self.model.buffers()):
            return tensor.device
        return torch.device("cpu")

    def _roundoff(self) -> float:
        """u of the lower of the two runs' precisions: the twin's perturbation. A float32 run whose matmuls or
        convolutions run TF32/HF32 (`precision_modes`: the target's flags now, the reference's as recorded) counts
        as that precision: its inputs are rounded to 10 mantissa bits, and a smaller perturbation would vanish in
        that rounding (measured on an H200: a TF32 target's twin then drifted by nothing, and a clean step was
        flagged at 115x its band)."""
        mine = amp_dtype_name(self.options.amp) or _param_dtype(self.model)
        meta = self._reference.meta
        theirs = amp_dtype_name(meta.get("amp")) or str(meta.get("dtype") or "float32")
        modes = (precision_modes.current(self._device().type), precision_modes.from_attr(meta.get(PRECISION_MODES)))
        return max(unit_roundoff(mine), unit_roundoff(theirs), *(precision_modes.roundoff(m) for m in modes))

    # -- what the loop calls ------------------------------------------------------------------------------------------
    def _active(self, what: str):
        if self._current is None:
            raise OneIterError(f"rec.{what}() works inside a step: rec.run(fn) or `with rec.step(s):`", param=what)
        return self._current

    def inputs(self, *args, **kwargs):
        """The step's batch (`Recorder.inputs`): stored, and on replay the reference's step's in its place."""
        return self._active("inputs").inputs(*args, **kwargs)

    def loss(self, tensor):
        """Name the step's loss (`Recorder.loss`)."""
        return self._active("loss").loss(tensor)

    def note(self, **attrs) -> None:
        """Extra attributes of the step being recorded."""
        self._active("note").note(**attrs)

    def locate(self, exc, frame):
        current = self._current
        return current.locate(exc, frame) if isinstance(current, Recorder) else None


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    """The largest symmetric relative difference between two signature rows (0: bit for bit)."""
    scale = np.maximum(np.maximum(np.abs(a), np.abs(b)), np.finfo(np.float64).tiny)
    diff = np.abs(a - b) / scale
    diff[(a == b) | (np.isnan(a) & np.isnan(b))] = 0.0
    return float(np.nanmax(diff)) if diff.size else 0.0


def _param_dtype(model) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def _shown(steps: Sequence[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if list(steps) == list(range(steps[0], steps[-1] + 1)) else str(list(steps))

