"""`oneiter.Recorder`: record one training iteration of a live model in the user's own loop.

Every way into a recording goes through this class: the `oneiter record` CLI (`record/run.py` builds the model
from its spec and drives `runtime.training.train_step` inside a `Recorder`), the mmengine hook, the Hugging Face
`TrainerCallback`, and a user's own loop::

    with oneiter.Recorder(model, "ref.h5", optimizer=opt) as rec:
        loss = loss_fn(model(*rec.inputs(x, y)))        # on replay: the reference's x and y, on x's device
        loss.backward()
        opt.step()

What it does inside the block, in order:

- on enter: (with `replay=`) checks the model's structure against the reference and loads its weights and
  buffers bit for bit; opens the output as a temporary file beside `out`; writes `state_before`; seeds torch's,
  Python's and numpy's generators (`seed`, so dropout draws the same numbers on both sides); starts random-op
  recording (reference) or replay (target) and the module hooks; enters autocast when `amp=` is given and
  `manage_autocast` is True;
- the batch: `rec.inputs(...)` stores its arguments as `batch/` and, on replay, returns the reference's tensors
  in their place. Without `rec.inputs`, the arguments of the model's first forward call are the batch (and are
  swapped the same way) — what the framework integrations use;
- microbatches (gradient accumulation): each further `rec.inputs(...)`, or without it a call of the model after a
  backward returned, begins the next microbatch of the same iteration, with its own batch (on replay the
  reference's microbatch's), random values and loss; autocast is entered again for its forward. Everything up to
  the optimizer's step is one recording (docs/format.md "Microbatches");
- the loss: the tensor the first `.backward()` of each microbatch runs on (autocast ends there), unless
  `rec.loss(t)` names it explicitly (do that under a GradScaler, whose backward runs on the scaled loss); with
  several microbatches the file's loss is their sum;
- parameter gradients: as accumulated when the last backward returned (before clipping or unscaling changes
  them: a host copy is kept after each backward), stored right before the first step of `optimizer`, or when the
  block ends; the teacher-forced probes judge the optimizer's update right before it steps, when there is exactly
  one optimizer and nothing changed the gradients in between;
- on exit: `state_after`, the loss, the `/local` table; the file is renamed into place only now. An exception
  in the block removes every hook and leaves no file behind.

Under torchrun (several ranks) rank R writes `<stem>.rank<R>.h5` and replays `<ref stem>.rank<R>.h5`.
Errors raised here name the parameter (`amp`, `replay`), never a CLI flag: the CLI maps them.
"""

from __future__ import annotations

import enum
import json
import math
import os
import shutil
import sys
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from oneiter.errors import OneIterError, warn
from oneiter.format.layout import IterationFile
from oneiter.format.optimizer_state import LOADED, NOT_RECORDED, OPTIMIZER_STATE, RECORDED, updates_not_judged
from oneiter.format.schema import (
    BATCH,
    GRAD_REDUCTION,
    LOSS,
    MICROBATCHES,
    OPTIMIZER,
    OPTIMIZER_CLASS,
    PRECISION_MODES,
    RANDOM,
    ROOT_MODULE,
    STATE_BEFORE,
    STATE_NAMES,
)
from oneiter.format.writer import DEFAULT_QUEUE_BYTES
from oneiter.record.capture import raised_at
from oneiter.record.capture.batch import BatchSwap, batch_rows
from oneiter.record.capture.blocks import compiled_attr, compiled_notes, refuse
from oneiter.record.capture.hooks import next_node_number, unscaled
from oneiter.record.capture.microbatches import Microbatches, reference_swaps, refuse_accumulated
from oneiter.record.capture.optimizer_step import before_update
from oneiter.record.modes.float8 import convert as convert_float8
from oneiter.record.modes.pipeline import PipelineWatch
from oneiter.record.options import CALIBRATIONS, LEVELS, RecordOptions, amp_name, module_selector, regex_list
from oneiter.record.session import RecordingSession, atomic_output, check_output
from oneiter.record.start.optimizer_start import load_start, start_entries
from oneiter.record.start.reference import load_state
from oneiter.record.start.state_names import qualified, renamed
from oneiter.runtime import precision_modes
from oneiter.runtime.compiled import CompileWatch, compile_modules, eager_name, outside_call, recordable_compiles
from oneiter.runtime.devices import device_name
from oneiter.runtime.distributed import current_rank, rank_path, replay_path
from oneiter.runtime.host_random import seed_all
from oneiter.runtime.names import state_tensors
from oneiter.runtime.precision import AMP_DTYPES, active_autocast, amp_dtype_name, autocast_for
from oneiter.runtime.sharding import class_name, is_sharded, local, reduction
from oneiter.runtime.wrappers import (
    accumulation_steps,
    grad_scalers,
    model_forward_cast,
    unwrap_model,
    unwrap_optimizers,
)
from oneiter.version import __version__

__all__ = ["Recorder", "RecordSummary", "RecordOptions", "Phase", "module_selector", "regex_list", "CALIBRATIONS",
           "LEVELS", "optimizer_list", "model_of"]


@dataclass
class RecordSummary:
    """What one recording wrote."""

    path: Path
    num_entries: int
    num_bytes: int
    file_bytes: int
    seconds: float  # the Recorder block (iteration, capture, writes); record() makes it its whole call
    loss: float
    num_calls: int
    iteration_seconds: float = 0.0  # the Recorder block alone: the recorded iteration and its writes
    compile_seconds: float = 0.0  # torch.compile's compiling inside the block (never part of the seconds above)
    # a multi-step recording (`record/steps/step_recorder.py`): its iterations (num_entries: its tensors)
    num_steps: int = 0
    impact_runs: int = 0  # `impact=True`: the iterations run again from the start (`record/impact/runs.py`)
    impact_seconds: float = 0.0  # what they took (part of `seconds`)


class Phase(enum.IntEnum):
    """Where the recorded iteration is, along `_MOVES`: forward, backward and gradients once per microbatch (a
    further microbatch goes back to FORWARD), then the step; what an event does depends on it alone (a later
    forward or a second step after the step find the phase past theirs and do nothing)."""

    IDLE = 0  # constructed, the block not entered
    OPEN = 1  # inside the block: hooks attached, no batch yet
    FORWARD = 2  # a microbatch's batch is taken (rec.inputs, or the model's call): its forward runs
    BACKWARD = 3  # a backward runs: autocast ended, its microbatch's loss is known
    GRADS = 4  # the backward returned: gradients as accumulated so far kept, random/fallback modes paused
    STEPPED = 5  # the optimizer's first step began: gradients stored, deferred probes run, its update judged
    CLOSED = 6  # the block ended


# each phase, and the phases it may be entered from (the only place the order of an iteration is written down);
# once the gradients are stored (`Recorder._settle_grads`: the step began, or the block ends) no microbatch follows
_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.OPEN: frozenset({Phase.IDLE}),
    Phase.FORWARD: frozenset({Phase.OPEN, Phase.FORWARD, Phase.GRADS}),  # the next microbatch
    Phase.BACKWARD: frozenset({Phase.FORWARD, Phase.GRADS}),  # GRADS: a second backward of a microbatch
    Phase.GRADS: frozenset({Phase.FORWARD, Phase.BACKWARD}),  # no backward seen: read at the step or the end
    Phase.STEPPED: frozenset({Phase.GRADS}),
    Phase.CLOSED: frozenset(Phase) - {Phase.CLOSED},
}


class Recorder:
    """Record the training iteration run inside the `with` block into the HDF5 file `out`.

    Args:
        model: the live `nn.Module` (the inner module under DDP: its names are the recording's names; a model
            sharded with FSDP2's `fully_shard` as it is).
        out: the `.h5` file to write; never overwritten unless `force=True`.
        optimizer: the optimizer (or a list of them) that steps this iteration, or None.
        replay: a reference recording: its weights, buffers and batch are loaded, its random values replayed,
            and every module call is judged locally against it (`isolate`).
        amp: "bf16" / "fp16": the run's autocast dtype (entered around forward when `manage_autocast`).
        include / exclude: regexes on module paths to record / skip.
        seed: torch's, Python's and numpy's generators seeded when the block starts (None: leave them alone).
        isolate: with `replay`, rerun every call teacher-forced on the reference's values (local error).
        calibrate: where expected noise is measured: "cpu" (float64 vs the run's precision) or "device".
        against: "cpu": no reference; judge each call against a float32 CPU recomputation of this run's values.
        random_replay: with `replay`, random ops take the reference's values.
        fallback: regexes of aten ops run on the CPU in float32 (README: `--fallback`).
        force: overwrite `out` if it exists (never the `replay` file itself).
        name: the file's `model` attribute (default: the reference's on replay, else the model's class name).
        meta: more root attributes (JSON-able scalars), e.g. what built the model.
        progress: `progress(phase, num_tensors)` after each captured tensor.
        notify: `notify(message)` for one-line notes while recording (the size estimate once forward is done).
        manage_autocast: False when the training code enters autocast itself (mmengine, Trainer).
        skip: module paths never recorded, whatever `include` says (e.g. a data preprocessor).
        level: "full" (every tensor's data) or "stats" (statistics and a checksum per tensor, `format.stats`;
            random values and — unless this is a replay — the batch and state_before stay full, so it can be replayed).
        compile: a torch.compile backend name ("inductor"; True: inductor): the model is compiled in place for the
            block (or each module `compile_modules` matches, one block each) and left as it was after it. A model
            that arrives compiled (torch.compile, `.compile()`) is recorded as it is, with or without this.
        compile_modules: regexes on module paths: with `compile`, each outermost matching module is compiled alone.
        float8: "tensorwise" / "rowwise": the model's Linears converted to torchao's float8 training for the block
            and converted back after it (`record/modes/float8.py`: those with dimensions divisible by 16, not the
            output projection; needs `pip install -c constraints.txt 'oneiter[float8]'`).
        impact: with `replay`, rank the flagged calls by how much of the gap fixing each closes: the iteration, given
            as a function (`rec.run(fn)`), runs again from its start once per flagged call with that call fixed, and
            once with all fixed (`record/impact/`, docs/impact.md).
        impact_top: with `impact`, fix at most this many flagged calls, largest own error first.

    `out` and every keyword but `optimizer`, `progress` and `notify` become one checked `RecordOptions`
    (`self.options`); `Recorder.from_options` takes one built beforehand. The block's progress is one `Phase`
    (`self.phase`). Several consecutive iterations into one file: `oneiter.StepRecorder`, which takes the same
    keywords and `steps=N` (`record/steps/step_recorder.py`).
    """

    def __init__(
        self,
        model,
        out: str | os.PathLike,
        *,
        optimizer=None,
        replay: str | os.PathLike | None = None,
        amp: str | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        seed: int | None = 0,
        isolate: bool = True,
        calibrate: str = "cpu",
        against: str | None = None,
        random_replay: bool = True,
        fallback: Sequence[str] = (),
        force: bool = False,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
        progress: Callable[[str, int], None] | None = None,
        notify: Callable[[str], None] | None = None,
        manage_autocast: bool = True,
        skip: Iterable[str] = (),
        queue_bytes: int | None = None,
        level: str = "full",
        compile: str | bool | None = None,
        compile_modules: str | Sequence[str] | None = None,
        float8: str | None = None,
        impact: bool = False,
        impact_top: int | None = None,
    ):
        model = model_of(model)
        options = RecordOptions(
            out=out, replay=replay, amp=amp, include=include, exclude=exclude, seed=seed, isolate=isolate,
            calibrate=calibrate, against=against, random_replay=random_replay, fallback=fallback, force=force,
            name=name, meta=meta, manage_autocast=manage_autocast, skip=skip,
            queue_bytes=queue_bytes or DEFAULT_QUEUE_BYTES, level=level, compile=compile,
            compile_modules=compile_modules, float8=float8, impact=impact, impact_top=impact_top,
        )
        self._setup(model, options, optimizer, progress, notify)

    @classmethod
    def from_options(cls, model, options: RecordOptions, *, optimizer=None,
                     progress: Callable[[str, int], None] | None = None,
                     notify: Callable[[str], None] | None = None, reference=None, start: bool = True,
                     step_of: bool = False) -> "Recorder":
        """A Recorder of `options` (built, and so checked, beforehand: what `record()` and the integrations use).

        For one step of a multi-step recording (`record/steps/step_recorder.py`): `reference` is the open reference
        iteration to
        replay (a step of a multi-step reference) instead of opening `options.replay`, and `start=False` records
        an iteration that continues the run: a replay loads no weights or optimizer state, and a reference keeps
        its `state_before` and optimizer state as statistics at the stats level (only the first step's are kept
        in full: where a replay starts). `step_of`: the iteration is a step of a multi-step recording, whose notes
        of one iteration's file (its size, its lack of per-call local error) do not apply."""
        model = model_of(model)
        recorder = cls.__new__(cls)
        recorder._setup(model, options, optimizer, progress, notify)
        recorder._given_ref, recorder._start, recorder._step_of = reference, start, step_of
        if step_of:  # the multi-step recorder named this rank's files already
            recorder.out, recorder.replay = options.out, options.replay
        return recorder

    def _setup(self, model, options: RecordOptions, optimizer, progress, notify) -> None:
        """The checks that need the model, and the state of a Recorder whose block has not started."""
        self.model, self.options = model, options
        self._select = options.selector()
        paths = [eager_name(p) for p, _ in model.named_modules()]
        if (options.include or options.exclude) and not any(self._select(p) for p in paths):
            first = next((p for p in paths if p), "(root)")
            raise OneIterError(f"include {options.include} / exclude {options.exclude} leave no module of the model "
                               f"to record (module paths look like '{first}')", param="include")
        self._forward_cast = model_forward_cast(model)  # accelerate's mixed precision: the recording's autocast
        if self._forward_cast is not None:
            self.options = options = _forward_autocast(options, self._forward_cast)
        self.optimizers = optimizer_list(optimizer)
        self._scalers = grad_scalers(optimizer)  # accelerate's AcceleratedOptimizer steps through its GradScaler
        self._accumulation = accumulation_steps(optimizer)  # what its wrapper says it accumulates over (the errors)
        self.progress, self.notify = progress, notify
        self.estimated_bytes: int | None = None  # the whole file, estimated once forward is done
        self.rank = current_rank()
        self.out, self.replay = options.out, options.replay
        if self.rank.distributed:
            self.out = rank_path(self.out, self.rank.rank, self.rank.world_size)
            self.replay = replay_path(self.replay, self.rank) if self.replay is not None else None
        self.summary: RecordSummary | None = None
        self.phase = Phase.IDLE
        self._stack: ExitStack | None = None
        self._loss = None  # the iteration's loss, once the block ends
        self._mb = Microbatches()  # the microbatches begun, and each one's loss
        self._settled = False  # the gradients are stored (the step began, or the block ends): no microbatch follows
        self._backwards = 0  # backwards run in the block
        self._swap: list[BatchSwap] | None = None  # a replay: the reference's batch of each microbatch
        self._grad_versions: dict[str, int] = {}
        self._first_call: tuple | None = None  # the model's call of this microbatch: (args, kwargs, first node)
        self._failed_backward: tuple | None = None  # (the exception backward raised, the tensor it ran on)
        self._given_ref, self._start = None, True  # `from_options`: a step of a multi-step recording
        self._step_of = False
        self.optimizer_start = ""  # the file's `optimizer_state` (format/optimizer_state.py), set on enter
        self._meta_batch_size = 0  # the batch size the file's attributes state (0: its batch's rows, once taken)
        self._iteration: Callable[[], Any] | None = None  # `run(fn)`'s fn: what `impact` runs again
        self._impact_start = None  # `impact`: the iteration's start (`record/impact/start.py`)
        self._pass = None  # the impact run in progress: `inputs`, `loss` and `note` are its
        if options.impact and self.rank.distributed:
            raise OneIterError("impact runs the iteration again in one process: record without torchrun",
                               param="impact")

    def _advance(self, to: Phase) -> bool:
        """Enter phase `to` if the iteration may go there from where it is (`_MOVES`); whether it did. A backward
        or a step before the model ran has no batch to go with: refused, as the block's end would refuse it."""
        if self._settled and to in (Phase.FORWARD, Phase.BACKWARD):
            return False
        if self.phase in _MOVES[to]:
            self.phase = to
            return True
        if self.phase is Phase.OPEN and to in (Phase.BACKWARD, Phase.GRADS, Phase.STEPPED):
            raise _never_called()
        return False

    # -- the block ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":

        if self.phase is not Phase.IDLE:
            raise OneIterError("a Recorder records one block: make a new one for another iteration", param="model")
        opts = self.options
        if opts.impact_from is not None:
            raise OneIterError("impact_from names the calls to fix at every step of a multi-step replay; a replay of "
                               "one iteration fixes the calls it flags itself: drop impact_from", param="impact_from")
        check_output(self.out, opts.force)
        # a sharded (FSDP2) tensor is stored as this rank's shard
        state = sum(local(t).numel() * t.element_size() for _, t, _ in state_tensors(self.model))
        params = sum(local(p).numel() * p.element_size() for p in self.model.parameters())
        # state_before (full unless a stats-level replay), state_after and parameter gradients (full level only)
        before = state if opts.level == "full" or self.replay is None else 0
        self._state_bytes = before + (state + params if opts.level == "full" else 0)
        _check_space(self.out, self._state_bytes, "at least (the model's state and gradients it stores in full)")
        if self.replay is not None and _same_file(self.replay, self.out):
            raise OneIterError(f"out '{self.out}' is the reference being replayed; write the replay elsewhere",
                               param="out")
        self._started = time.perf_counter()
        stack = ExitStack()
        try:
            stack.callback(self._float8())  # first: hooks, compilation and the reference's weights see it
            stack.callback(self._compile())
            self.ref = self._given_ref if self._given_ref is not None else (
                stack.enter_context(IterationFile(self.replay)) if self.replay is not None else None)
            self.device = _device_of(self.model)
            # the reduced-precision flags in force (TF32...): in the file, and reproduced by the calibration
            self.precision_modes = precision_modes.current(self.device.type)
            self._swap = self._load_reference() if self.ref is not None else None
            # the optimizer's state as the step begins (after a replay loaded the reference's): in the file
            opt_entries, stored = start_entries(self.optimizers, self.model)
            if self.ref is None or not self._start:
                self.optimizer_start = stored  # a reference (or a run continuing): what its optimizer holds
            elif NOT_RECORDED in (stored, self.optimizer_start):  # a replay's start that cannot be stored
                opt_entries, self.optimizer_start = [], NOT_RECORDED
            tmp = stack.enter_context(atomic_output(self.out, opts.force))
            probe_factory, self.local_kind = self._probe_factory()
            self.session = stack.enter_context(RecordingSession(
                self.model, tmp, self._meta(), select=self._select, progress=self.progress,
                probe_factory=probe_factory, keep_values=self.local_kind == "against_cpu",
                stats_groups=self._stats_groups() if opts.level == "stats" else None, queue_bytes=opts.queue_bytes,
            ))
            self._bind_session()
            self.session.state_before()
            self.session.optimizer_state(opt_entries)
            del opt_entries
            self._before_bytes = self.session.sink.num_bytes
            if opts.seed is not None:
                seed_all(opts.seed)  # torch's, Python's and numpy's generators
            if opts.impact:
                from oneiter.record.impact.start import Start  # imports torch

                self._impact_start = Start(self.model, self.optimizers)
            self._attach(stack)
        except BaseException:
            stack.__exit__(*sys.exc_info())  # with the exception: atomic_output deletes, never renames
            raise
        self._stack = stack
        self._advance(Phase.OPEN)
        for scaler in self._scalers:
            self.loss_scale(scaler)
        self.session.enter_phase("forward")
        return self

    def _bind_session(self) -> None:
        """What the session needs of this block: the reference's call numbering (a replay numbers each module's
        calls as its reference did: `hooks.pair_with`), the optimizer and where it starts."""
        if self.ref is not None:
            self.session.module_capture.pair_with(self.ref.calls())
        if len(self.optimizers) == 1:
            self.session.bind_optimizer(self.optimizers[0])
        if self.session.probe is not None:
            self.session.probe.optimizer_start = self.optimizer_start

    def _attach(self, stack: ExitStack) -> None:
        """The modes, hooks and patches of the block, each undone by `stack`."""
        opts = self.options
        self._modes = self._make_modes()
        if self._forward_cast is not None:  # the model's own outputs, not accelerate's float32 copies of them
            stack.callback(self._forward_cast.uncast())
        capture = stack.enter_context(self.session.capture())
        refuse(capture.blocks, fallback=bool(opts.fallback), ref=self.ref)
        if capture.blocks:  # compiled code draws random numbers the random modes see (`runtime/compiled.py`)
            stack.enter_context(recordable_compiles())
        self._watch = stack.enter_context(CompileWatch(capture.open_block, capture.is_suspended))
        stack.enter_context(self._modes)
        stack.callback(self._remove_hooks)
        self._hooks = outside_call(self.model, self._first_forward, prepend=True)
        self._hooks += [before_update(opt, self._before_step) for opt in self.optimizers]
        self._patch_backward(stack)
        self._autocast = None
        if opts.amp and opts.manage_autocast:
            self._autocast = autocast_for(self.device, opts.amp)
            self._autocast.__enter__()
            stack.callback(self._end_autocast)

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            self._finish(stack, exc_type, exc, tb)
        finally:
            self._advance(Phase.CLOSED)
            # what the block needed (the session, its probe's caches of reference tensors, the random modes,
            # the open reference) goes now: a loop that records again must not hold the previous recording's
            self.session = self._modes = self.ref = self._swap = self._watch = None
            self._first_call = self._failed_backward = self._impact_start = self._iteration = None

    def _finish(self, stack: ExitStack, exc_type, exc, tb) -> None:
        self._end_autocast()
        if exc_type is not None:  # every hook removed; atomic_output deletes the temporary file
            stack.__exit__(exc_type, exc, tb)
            return
        with stack:
            self._remove_hooks()
            if not self._mb.has_backward():
                raise OneIterError("the Recorder block ended before any backward ran, so it holds no training "
                                   "iteration: run the loss's backward (and the optimizer's step) inside the `with` "
                                   "block, or name the loss with rec.loss(tensor)", param="model")
            if self.phase is Phase.OPEN:
                raise _never_called()
            self._mb.check_replayed(self._swap, self.ref.path.name if self.ref is not None else "")
            self._settle_grads()
            self.session.enter_phase("writing")
            self.session.state_after()
            # the tensor each backward ran on: the loss times the GradScaler's scale
            losses = self._mb.values(lambda t: unscaled(t, self.session.module_capture.grad_scale))
            self._loss = self._mb.total(losses)
            if self._mb.count > 1:
                self.session.microbatch_losses(self._mb.as_floats(losses))
                self.session.extra_attrs[MICROBATCHES] = self._mb.count
            impact = self._measure_impact() if self.options.impact else {}
            reduced = reduction(self.model, self.rank.world_size, self._modes.reduced_grads())
            self._watch.__exit__(None, None, None)  # before the attribute that says what it saw is written
            compiled = compiled_attr(self.session.module_capture.blocks, self._watch, self._modes.random.num_compiled)
            counts = self.session.finish(self._loss, {**self._modes.summary(), GRAD_REDUCTION: reduced, **compiled})
            for line in compiled_notes(compiled) if self.notify is not None and not self._step_of else ():
                self.notify(line)
        compiling = self._watch.total_seconds
        self.summary = RecordSummary(
            self.out, counts[0], counts[1], self.out.stat().st_size, time.perf_counter() - self._started - compiling,
            float(self._loss.float()), self.session.module_capture.num_calls, compile_seconds=compiling,
        )
        self.summary.iteration_seconds = self.summary.seconds
        if impact:
            self.summary.impact_runs, self.summary.impact_seconds = impact["runs"], impact["seconds"]

    @property
    def num_microbatches(self) -> int:
        """How many microbatches of the iteration have begun (each `rec.inputs`, or the model's call after a
        backward: docs/format.md "Microbatches")."""
        return self._mb.count

    # -- what the loop calls -----------------------------------------------------------------------------------------
    def run(self, fn: Callable[[], Any]) -> Any:
        """Run the block's iteration `fn()` (the loop's body: its batch through `rec.inputs`, forward, loss, backward,
        the optimizer's step) and return what it returns. With `impact=True` this is how the iteration is given: it
        runs again from its start once per flagged call when the block ends (keep other side effects out of it)."""
        self._active("run")
        if self._iteration is not None:
            raise OneIterError("rec.run() runs the block's one iteration: call it once", param="run")
        self._iteration = fn
        return fn()

    def _measure_impact(self) -> dict:
        """`impact`: the runs of `record/impact/runs.py`, their table into the file; returns their count and seconds."""
        from oneiter.record.impact.gaps import ReferenceGaps  # imports torch
        from oneiter.record.impact.runs import Impact, measure, one_pass, perturbation

        if self._iteration is None:
            raise _no_iteration()
        capture, progress = self.session.module_capture, self.progress
        scale = capture.grad_scale  # a loss `rec.loss` named is taken as it is (`ReferencePass.loss_tensor`)
        gaps = ReferenceGaps(self.ref, self.model)
        run_dtype = amp_dtype_name(self.options.amp) or str(_param_dtype(self.model) or "float32").replace("torch.", "")
        job = Impact(self._impact_start,
                     lambda targets, **how: one_pass(self.model, self.ref, self.options, self.device, targets,
                                                     self._impact_run, scale, gaps, optimizers=self.optimizers, **how),
                     float(self._loss.float()), self.device.type,
                     (lambda text: progress(text, self.session.sink.num_tensors)) if progress else None,
                     roundoff=perturbation(run_dtype, self.ref.meta, self.precision_modes))
        self.session.enter_phase("impact")
        with capture.suspended():
            rows, attrs = measure(job, self.session.probe.rows if self.session.probe else [], run_dtype,
                                  self.options.impact_top)
        self.session.writer.impact_table(rows, attrs)
        return {"runs": len(rows), "seconds": float(attrs.get("seconds", 0.0))}

    def _impact_run(self, step) -> None:
        """One impact run: the iteration again, `step` (an `ImpactPass`) handing out its batch and taking its loss."""
        self._pass = step
        try:
            self._iteration()
        finally:
            self._pass = None

    def inputs(self, *args, **kwargs):
        """Store these model inputs as the recording's batch; on replay return the reference's in their place.

        One argument comes back as one value, several as a tuple (`model(*rec.inputs(x, y))`), keyword arguments
        as `(args, kwargs)`. Tensors may be nested in lists, tuples and dicts; each is moved to the device and
        cast to the dtype of the tensor it replaces. Each call begins a microbatch: call it once per microbatch
        when the iteration accumulates gradients over several before its step (docs/format.md "Microbatches").
        """
        if self._pass is not None:
            return self._pass.inputs(*args, **kwargs)
        self._active("inputs")
        if not self._begin_microbatch():
            raise OneIterError("rec.inputs() after the optimizer's step: a Recorder block records one iteration, "
                               "its microbatches before its step; record the next one in a new block",
                               param="inputs")
        self._mb.from_inputs = True
        args, kwargs = self._take_batch(args, kwargs)
        if kwargs:
            return args, kwargs
        return args[0] if len(args) == 1 else tuple(args)

    def loss(self, tensor):
        """Name the loss of this iteration (of the microbatch whose forward runs) explicitly (default: the tensor the
        first backward runs on)."""
        if self._pass is not None:
            return self._pass.loss(tensor)
        self._active("loss")
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1:
            raise OneIterError(f"loss must be a one-element tensor, got {type(tensor).__name__}", param="loss")
        self._mb.note_loss(self._mb.current, tensor.detach(), explicit=True)
        return tensor

    def loss_scale(self, scale) -> None:
        """The loss backward runs on is the loss times `scale` (a float, or a `torch.amp.GradScaler`: its current
        scale, the factor its `scale(loss)` applies). The file then holds the loss and every gradient divided by it,
        exactly (a GradScaler's scale is a power of two), as an unscaled run of the same precision has them; its
        root attribute `loss_scale` says by what. Call it before the backward (the Lightning callback does, for
        `16-mixed`). A Recorder given accelerate's `AcceleratedOptimizer` reads its scaler by itself."""
        self._active("loss_scale")
        value = float(scale.get_scale() if hasattr(scale, "get_scale") else scale)
        if not (value > 0 and math.isfinite(value)):
            raise OneIterError(f"loss_scale must be a positive finite number, got {value}", param="loss_scale")
        if self.phase >= Phase.BACKWARD:
            raise OneIterError("rec.loss_scale() comes before the backward (the gradients are stored as it runs)",
                               param="loss_scale")
        self.session.module_capture.grad_scale = value
        self.session.extra_attrs["loss_scale"] = value

    def note(self, **attrs) -> None:
        """Extra root attributes for the file (JSON-able values), written when the block ends."""
        if self._pass is not None:
            return
        self._active("note")
        self.session.extra_attrs.update(attrs)

    # -- internals ---------------------------------------------------------------------------------------------------
    def _active(self, what: str) -> None:
        if self._stack is None:
            raise OneIterError(f"rec.{what}() works only inside `with Recorder(...) as rec:`", param=what)

    def _take_batch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The batch of the microbatch that just began: stored, and on replay the reference's in its place."""
        if self.options.impact and self._iteration is None:  # refused before the iteration and its probes run
            raise _no_iteration()
        args, kwargs = self._mb.take(self.session.sink, args, kwargs, self._swap,
                                     self.ref.path.name if self.ref is not None else "")
        if not self._meta_batch_size and self._mb.current == 0:  # nothing said how large: its first tensor's rows
            rows = batch_rows(args, kwargs)
            if rows:
                self.session.extra_attrs.setdefault("batch_size", rows)
        return args, kwargs

    def _first_forward(self, module, args, kwargs):
        """The model's outermost call: it takes a microbatch's batch when it begins one (the first call, or the first
        after a backward returned), unless `rec.inputs` began the microbatch and handed the batch already."""
        if self.session.module_capture.is_suspended():  # a pipeline schedule's shape inference: no call of it
            return None
        if self._first_call is None:
            self._check_autocast()
        if self._mb.from_inputs:  # after rec.inputs(): the arguments are the batch already
            self._mb.from_inputs = False
            self._first_call = (args, kwargs, next_node_number())
            return None
        if not self._call_begins_microbatch() or not self._begin_microbatch():
            return None  # another call in this microbatch (two views of one batch), or after the step
        new_args, new_kwargs = self._take_batch(args, kwargs)
        self._first_call = (new_args, new_kwargs, next_node_number())
        return (new_args, new_kwargs) if self._swap is not None else None

    def _call_begins_microbatch(self) -> bool:
        """Whether a call of the model (without `rec.inputs` before it) begins a microbatch: the first call, or the
        first after a backward returned; a model called twice before its backward runs both calls in one."""
        return self.phase in (Phase.OPEN, Phase.GRADS)

    def _begin_microbatch(self) -> bool:
        """The next microbatch begins (its forward comes): numbered, its calls marked with it, and after a backward
        the random/fallback modes and the managed autocast on again. False after the step (none may begin)."""
        first = self.phase is Phase.OPEN
        if not self._advance(Phase.FORWARD):
            return False
        micro = self._mb.begin(next_node_number())
        self.session.module_capture.microbatch = micro
        if first:
            return True
        self._modes.resume()
        opts = self.options
        if opts.amp and opts.manage_autocast and self._autocast is None:
            self._autocast = autocast_for(self.device, opts.amp)
            self._autocast.__enter__()
        self.session.enter_phase("forward")
        return True

    def locate(self, exc: BaseException, frame: tuple[str, int, str] | None) -> tuple[str, str] | None:
        """Where in the model an exception of this block was raised: (what, where) — `the forward of
        layers.1.mlp@0`, `at file.py:31, in forward` — or None when it cannot say (`errors.user_code`'s
        `locate`; `record/capture/raised_at.py` finds it). Call it inside the block, before the exception leaves it."""
        if self._stack is None or self._pass is not None:
            return None
        capture = self.session.module_capture
        if self.phase in (Phase.OPEN, Phase.FORWARD):
            return raised_at.forward_place(capture, exc.__traceback__, frame)
        if self.phase is not Phase.BACKWARD:
            return None
        node = raised_at.function_node(exc.__traceback__) if frame is not None else None
        if node is not None:
            return raised_at.backward_place(capture, node, frame)
        failed = self._failed_backward
        node = raised_at.changed_saved_node(failed[1], exc) if failed is not None and failed[0] is exc else None
        if node is None or self._first_call is None:
            return None
        opts = self.options
        autocast = autocast_for(self.device, opts.amp) if opts.amp and opts.manage_autocast else None
        created, note = raised_at.creation_frame(self.model, self._first_call, capture, node, autocast)
        return raised_at.backward_place(capture, node, created, note)

    def _patch_backward(self, stack: ExitStack) -> None:
        """`Tensor.backward` and `torch.autograd.backward` (what pipeline schedules call) begin a backward: the
        tensor it runs on is its microbatch's loss, unless gradients are handed to it (a pipeline stage before the
        last runs its backward from the gradients the next stage sent: no loss of its own)."""
        import torch

        originals = (torch.Tensor.backward, torch.autograd.backward)
        recorder, running = self, []

        def patched(original, fed):
            def backward(tensor, *args, **kwargs):
                if running or not recorder._advance(Phase.BACKWARD):  # Tensor.backward calls autograd.backward
                    return recorder._backward(original, tensor, args, kwargs)
                running.append(True)
                try:
                    return recorder._run_backward(original, tensor, args, kwargs, fed(args, kwargs))
                finally:
                    running.clear()
            return backward

        torch.Tensor.backward = patched(originals[0], lambda a, k: k.get("gradient", a[0] if a else None))
        torch.autograd.backward = patched(originals[1], lambda a, k: k.get("grad_tensors", a[0] if a else None))
        stack.callback(setattr, torch.Tensor, "backward", originals[0])
        stack.callback(setattr, torch.autograd, "backward", originals[1])

    def _run_backward(self, original, tensor, args: tuple, kwargs: dict, grads):
        """One backward of the block (`_patch_backward`); `grads` the gradients handed to it, or None."""
        if not self._backwards:  # the block's first backward
            refuse_accumulated(self.model, self._accumulation)
            self._estimate()
        self._backwards += 1
        self._end_autocast()
        self._modes.resume()  # a second backward of a microbatch, after the first paused them
        self.session.enter_phase("backward")
        roots = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
        micro = self._mb.of_tensor(roots[0])
        given = [g for g in (grads if isinstance(grads, (list, tuple)) else [grads]) if g is not None]
        if given and any(getattr(r, "numel", lambda: 1)() > 1 for r in roots):  # not a loss (one times a scale)
            self._mb.backwards.add(micro)
            self._modes.backward_from(given, micro)
        else:
            self._mb.note_loss(micro, roots[0].detach())
        result = self._backward(original, tensor, args, kwargs)
        self._after_backward()  # before anything (clipping, unscaling) changes the gradients
        return result

    def _on_scaled(self, params: list, factor: float) -> None:
        """A pipeline schedule divided these parameters' gradients by `factor` after its last backward (before the
        step): the stored gradients stay as the last backward left them, and the step's are known exactly."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        divided = {}
        for param in params:
            name = names.get(id(param))
            if name is not None and param.grad is not None and name in self._grad_versions:
                divided[name] = factor
                self._grad_versions[name] = param.grad._version
        self.session.gradients_divided(divided)

    def _on_chunk(self, phase: str, chunk: int) -> None:
        """A pipeline schedule runs the forward or backward of its microbatch `chunk` on one of this rank's stages
        (`record/modes/pipeline.py`): the stage's calls belong to that microbatch, which begins here unless it
        did already (on another stage of this rank, or at `rec.inputs`)."""
        if self._settled:
            return
        if phase == "backward":
            self._mb.scheduled = chunk
            return
        self._mb.scheduled = -1
        while self._mb.count <= chunk:
            if not self._begin_microbatch():
                return
            self._mb.from_inputs = self._mb.count == 1 and self._first_call is None  # no batch in a stage call
        if self.phase is Phase.GRADS:  # a microbatch begun before: its forward on another of this rank's stages
            self._advance(Phase.FORWARD)
            self._modes.resume()
        self.session.module_capture.microbatch = chunk

    def _backward(self, original, tensor, args: tuple, kwargs: dict):
        """Run backward; if it raises, keep the tensor it ran on: `locate` walks its graph for the failing node."""
        try:
            return original(tensor, *args, **kwargs)
        except Exception as exc:
            self._failed_backward = (exc, tensor)
            raise

    def _estimate(self) -> None:
        """Forward is done: what was queued so far, as much again for the gradients of the same tensors, the
        parameter gradients and state_after. Refuse now if the output's filesystem cannot hold it."""
        sink = self.session.sink
        later = self._state_bytes - self._before_bytes  # state_after and parameter gradients, still to come
        forward = max(sink.num_bytes - self._before_bytes, 0)  # what forward wrote (and the batch)
        # backward stores the gradients of what forward stored: measured 1.3-1.45x forward's bytes on resnet18
        self.estimated_bytes = int(sink.num_bytes + 1.5 * forward + later)
        if self.notify is not None and not self._step_of:
            self.notify(f"forward recorded: the file will be about {_size(self.estimated_bytes)}")
        _check_space(self.out, self.estimated_bytes - sink.num_bytes, "about (forward measured, backward "
                     "estimated)", written=sink.num_bytes)

    def _end_autocast(self) -> None:
        autocast, self._autocast = getattr(self, "_autocast", None), None
        if autocast is not None:
            autocast.__exit__(None, None, None)

    def _before_step(self) -> None:
        """Right before the optimizer updates the weights (after the closure of a closure step: `before_update`)."""
        self._settle_grads()
        if self._advance(Phase.STEPPED):
            self.session.enter_phase("step")
            changed = any(p.grad is not None and p.grad._version != self._grad_versions.get(n)
                          for n, p in self.model.named_parameters())
            self.session.before_step(changed)

    def _check_autocast(self) -> None:
        """The autocast around the model's first call is the one `amp` says: each call's expected noise is measured
        in that precision, and a bf16 run judged as a float32 one would be all divergence."""
        on = active_autocast(self.device.type)
        if on is None or on == self.options.amp:
            return
        raise OneIterError(f"autocast ({AMP_DTYPES[on]}) is on around the model's forward, but this recording was "
                           f"given amp={self.options.amp!r}: give amp={on!r} (with manage_autocast=False when your "
                           f"code enters autocast itself)", param="amp")

    def _after_backward(self) -> None:
        """A backward returned: the gradients as accumulated so far kept (the next microbatch's backward adds to
        them; clipping or unscaling may change them before the step), the random/fallback modes paused until the
        next microbatch's forward."""
        self._advance(Phase.GRADS)
        self._modes.pause()
        self.session.keep_grads()
        self._grad_versions = {n: p.grad._version for n, p in self.model.named_parameters() if p.grad is not None}

    def _settle_grads(self) -> None:
        """The step begins (or the block ends): the last microbatch is done. End the random/fallback modes, run the
        probes, store the parameter gradients as the last backward left them (once). The optimizer's update is
        judged right before it steps (`_before_step`), when there is an optimizer."""
        if self._settled:
            return
        self._advance(Phase.GRADS)  # from FORWARD when no backward ran
        self._settled = True
        self._modes.close()
        if self.session.probe is not None:
            self.session.enter_phase("probes")
        self.session.step_start()  # before the probes: the optimizer rows of a replay read the reference's
        self.session.after_backward(step_later=bool(self.optimizers))
        self.session.param_grads(unreduced=self._modes.own_grads_kept())
        if not self._grad_versions:  # no backward ran: the gradients as the step finds them
            self._grad_versions = {n: p.grad._version for n, p in self.model.named_parameters()
                                   if p.grad is not None}

    def _float8(self) -> Callable[[], None]:
        """`float8=`: the model's Linears converted to torchao's float8 training in place; returns the undo."""
        if not self.options.float8:
            return lambda: None
        return convert_float8(self.model, self.options.float8)

    def _compile(self) -> Callable[[], None]:
        """`compile=`: compile the model (or the modules `compile_modules` names) in place; returns the undo."""
        opts = self.options
        if not opts.compile:
            return lambda: None
        return compile_modules(self.model, opts.compile, opts.compile_modules)

    def _remove_hooks(self) -> None:
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._hooks = []

    def _load_reference(self) -> list[BatchSwap]:
        """Load the reference's weights, buffers and optimizer state into the model and its optimizers (not for a
        step that continues a multi-step replay: `start=False`); return the swaps that hand out its batch, one per
        microbatch."""
        _check_world_size(self.ref, self.rank)
        if self.ref.steps():
            raise OneIterError(f"replay '{self.ref.path.name}' records {len(self.ref.steps())} steps: replay them with "
                               f"steps={len(self.ref.steps())} in an oneiter.StepRecorder (record --steps), or record "
                               f"one of them with --step",
                               param="replay")
        if self._start:
            _check_optimizer_given(self.ref, self.optimizers)
            load_state(self.model, self.ref)
            self.optimizer_start = load_start(self.optimizers, self.model, self.ref)
            why = updates_not_judged(str(self.ref.meta.get(OPTIMIZER_STATE) or ""), self.optimizer_start,
                                     _optimizer_names(self.optimizers))
            if why:
                warn(why, stacklevel=3)
        return reference_swaps(self.ref)

    def _make_modes(self) -> "_Modes":
        """The modes of forward and backward (random values, fallback, collectives), tied to the session."""
        opts = self.options
        modes = _Modes(self.session.sink, self.ref, self.device, opts.random_replay, opts.fallback,
                       self.session.module_capture, self.session.live_collective, self._on_chunk, self._on_scaled)
        self.session.attach_random(modes.random)
        self.session.attach_collectives(modes.collectives)
        if modes.collectives is not None and not is_sharded(self.model):
            self.session.watch_unreduced()  # DDP's reducer may average them: each rank's own are kept
        return modes

    def _stats_groups(self):
        """At the stats level: which groups hold statistics only. Random values and the loss stay full; so do the
        batch, state_before and the optimizer's state, except in a replay (whose start is the reference's: its
        checksums prove it) and, for the start, in a step that continues a multi-step recording."""
        full = {RANDOM, "", LOSS} | ({BATCH} if self.ref is None else set())
        full |= {STATE_BEFORE, OPTIMIZER} if self.ref is None and self._start else set()
        return lambda group: group.split("/", 1)[0] not in full

    def _probe_factory(self):
        """Which local-error probe reruns each call: teacher forcing on replay, or against the CPU."""
        from oneiter.record.local.probe import against_cpu_factory, teacher_forced_factory  # imports torch

        opts = self.options
        settings = {"amp": _amp_dtype(opts.amp), "dtype": _param_dtype(self.model), "calibrate": opts.calibrate,
                    "modes": self.precision_modes}
        if opts.against == "cpu":
            return against_cpu_factory(self.device, **settings), "against_cpu"
        if self.ref is None or not opts.isolate:
            return None, ""
        if opts.level == "stats" or self.ref.level == "stats":
            # local blame reruns each call on the reference's values: it needs full data
            if self.notify is not None and not self._step_of:
                self.notify("level stats: no per-call local error (it needs full recordings of both sides); "
                            "`oneiter compare --suggest` names the region to record in full")
            return None, ""
        return teacher_forced_factory(self.ref, self.device, **settings), "teacher_forced"

    def _meta(self) -> dict[str, Any]:
        """The file's root attributes (docs/format.md); `meta=` entries override these."""
        import torch

        opts = self.options
        dtype = _param_dtype(self.model)
        # a replay is of the reference's model: its name (and how it was built) unless told otherwise
        ref_meta = self.ref.meta if self.ref is not None else {}
        meta = {
            "model": opts.name or ref_meta.get("model") or class_name(self.model),
            "model_args": ref_meta.get("model_args") or "{}", "batch_size": ref_meta.get("batch_size") or 0,
            "seed": opts.seed if opts.seed is not None else -1, "rng_seed": opts.seed,
            "device": str(self.device), "device_type": self.device.type, "device_name": device_name(self.device),
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "float32", "amp": opts.amp,
            "float8": opts.float8 or "",
            "optimizer": _optimizer_names(self.optimizers), OPTIMIZER_STATE: self.optimizer_start,
            OPTIMIZER_CLASS: ",".join(qualified(o) for o in self.optimizers),
            "num_threads": torch.get_num_threads(), "torch_version": str(torch.__version__),
            "oneiter_version": __version__, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "replay_of": str(self.replay) if self.replay is not None else None,
            "include": json.dumps(opts.include), "exclude": json.dumps(opts.exclude), "faults": "[]",
            "fallback": json.dumps(opts.fallback),
            "random_replay": bool(self.replay is not None and opts.random_replay),
            "rank": self.rank.rank, "world_size": self.rank.world_size, "level": opts.level,
            PRECISION_MODES: precision_modes.to_attr(self.precision_modes),
            GRAD_REDUCTION: reduction(self.model, self.rank.world_size),  # until backward shows a reducer
        }
        names = {k: v for o in self.optimizers for k, v in renamed(o).items()}
        if names:  # the target's optimizer keeps the reference's state under other names (`state_names.py`)
            meta[STATE_NAMES] = json.dumps(names, sort_keys=True)
        meta.update(opts.meta)
        meta["local"] = self.local_kind
        self._meta_batch_size = int(meta.get("batch_size") or 0)
        return meta


class _Modes:
    """The torch modes active during forward and backward: random record/replay, op fallback, and (with a process
    group) the collectives' recorder (`record/modes/collectives.py`)."""

    def __init__(self, sink, ref, device, random_replay: bool, fallback: list[str], capture=None, on_output=None,
                 on_chunk=None, on_scaled=None):
        from oneiter.record.modes.collectives import CollectiveRecorder, is_distributed
        from oneiter.record.modes.fallback import OpFallback
        from oneiter.record.modes.randomness import RandomRecorder, RandomReplayer

        held = weakref.ref(capture) if capture is not None else lambda: None  # the capture counts this mode's ops:
        inside = lambda: _open_block(held())  # noqa: E731 - no cycle between them, which would outlive the block
        if ref is None:
            self.random = RandomRecorder(sink, inside=inside)
        else:  # without random replay: still count the random ops (each call notes which ones it ran)
            self.random = RandomReplayer(ref, device, replay=random_replay, inside=inside)
        self.fallback = OpFallback(fallback) if fallback else None
        self.pipeline = PipelineWatch(on_chunk, getattr(capture, "suspended", None), on_scaled) \
            if is_distributed() else None
        self.collectives = CollectiveRecorder(sink, capture, on_output, self.pipeline.tagged) if is_distributed() \
            else None
        self._stack, self._until_end = ExitStack(), ExitStack()

    def __enter__(self) -> "_Modes":
        if self.collectives is not None:  # first: dispatch modes leave in the reverse order they came
            self._until_end.enter_context(self.pipeline)
            self._until_end.enter_context(self.collectives)
        for mode in (self.random, self.fallback):
            if mode is not None:
                self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc) -> None:
        self.close(check=exc[0] is None)
        self._until_end.__exit__(*exc)  # after an error, a transfer nobody waited for is not waited for

    def close(self, check: bool = True) -> None:
        """End the modes (before the optimizer step: its math is not part of what they judge); the collectives are
        recorded until the block ends, the step's as its own phase (a tensor-parallel step reduces gradients).
        `check`: a replay replayed every random op of its reference."""
        paused, self._paused = self._paused, False
        self._stack.close()
        if paused and check and hasattr(self.random, "check_complete"):
            self.random.check_complete()  # left paused: its exit did not check
        if self.collectives is not None:
            self.collectives.stepping = True

    _paused = False

    def pause(self) -> None:
        """A backward returned: the random and fallback modes are left until the next microbatch's forward (or a
        further backward): what runs now (clipping) is no part of what they judge, and inside a Python dispatch mode
        torch's foreach in-place ops (clip_grad_norm_'s) do not move the version counters the Recorder reads. The
        collectives count as the step's until then."""
        self._backwards += 1
        if self.collectives is not None:
            self.collectives.backwards = self._backwards
        if self._paused:
            return
        self._paused = True
        self.random.pausing = True
        try:
            self._stack.close()
        finally:
            self.random.pausing = False
        if self.collectives is not None:
            self.collectives.stepping = True

    def resume(self) -> None:
        """A microbatch's forward (or a further backward) runs: the modes are entered again."""
        if not self._paused:
            return
        self._paused = False
        for mode in (self.random, self.fallback):
            if mode is not None:
                self._stack.enter_context(mode)
        if self.collectives is not None:
            self.collectives.stepping = False

    def backward_from(self, grads: list, microbatch: int) -> None:
        """A backward of `microbatch` runs from these gradients: a point-to-point op that received one moved a
        gradient."""
        if self.collectives is not None:
            self.collectives.p2p.backward_from(grads, microbatch)

    def reduced_grads(self) -> bool:
        """Whether a reducer (DDP's) averaged the parameter gradients over ranks in backward."""
        return self.collectives is not None and self.collectives.reduced_grads

    def own_grads_kept(self) -> bool:
        """Whether the gradients kept before the reducer averaged them are this rank's own sums: a reducer ran, in
        the last backward only. A pipeline schedule over DDP (`torch.distributed.pipelining`) lets DDP reduce in an
        earlier microbatch's backward too; the next backward then adds to averaged gradients, and no rank's own sum
        is ever held: nothing is stored as one (`param_grads_unreduced`), and the parameter rows go unjudged."""
        return self.reduced_grads() and self.collectives.reduced_only_last(self._backwards)

    _backwards = 0  # backwards returned so far

    def summary(self) -> dict:
        """The modes' root attributes; the point-to-point ops completed and described first (the file closes next)."""
        if self.collectives is not None:
            self.collectives.settle()
        return {
            "num_random_ops": self.random.num_ops,
            "fallback_counts": json.dumps(self.fallback.counts if self.fallback is not None else {}),
        }


def _open_block(capture) -> str:
    """The compiled block whose call is open now, in words ("the compiled block layers.0 (inductor)"), or ""."""
    path = capture.open_block() if capture is not None else None
    if path is None:
        return ""
    return f"the compiled block {path or ROOT_MODULE} ({capture.blocks.by_path[path].backend})"


def model_of(model):
    """The module a recording names: `model` itself, or the one inside a DDP / DataParallel wrapper
    (`runtime/wrappers.py`; the wrapper is still what the loop calls). A `torch.compile` wrapper is kept: it is the
    compiled block, hooked from outside its compiled code, its modules named by their eager names."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise OneIterError(f"model must be a torch.nn.Module, got {type(model).__name__}", param="model")
    return unwrap_model(model, compiled=False)


def _never_called() -> OneIterError:
    return OneIterError("the model was never called inside the Recorder block, so there is no batch to record: "
                        "give the Recorder the module your training code calls, or hand the batch to "
                        "rec.inputs(...)", param="model")


def _no_iteration() -> OneIterError:
    return OneIterError("impact runs the iteration again from its start: give it as a function, rec.run(fn), inside "
                        "the block", param="impact")


def optimizer_list(optimizer) -> list:
    """The torch optimizers of `optimizer`: one, a list, or what frameworks wrap them in (accelerate's
    `AcceleratedOptimizer`, Lightning's `LightningOptimizer`, mmengine's `OptimWrapper`) or step them with (an LR
    scheduler: its optimizer), each unwrapped (`runtime/wrappers.py`)."""
    if optimizer is None:
        return []
    items = unwrap_optimizers(optimizer)
    for item in items:
        if not hasattr(item, "register_step_pre_hook"):
            raise OneIterError(f"optimizer must be a torch.optim.Optimizer, a wrapper of one (accelerate's "
                               f"AcceleratedOptimizer, ...) or its LR scheduler, or a list of them; got "
                               f"{type(item).__name__}", param="optimizer")
    return items


def _optimizer_names(optimizers) -> str:
    return ",".join(type(o).__name__.lower() for o in optimizers)


def _check_optimizer_given(ref, optimizers) -> None:
    """A reference whose optimizer held state (Adam's moments, momentum) is replayed by an optimizer that loads it:
    without one, the target's optimizer steps from its own state and every updated weight differs."""
    if optimizers or str(ref.meta.get(OPTIMIZER_STATE) or "") not in (RECORDED, LOADED):
        return
    name = str(ref.meta.get("optimizer") or "optimizer")
    raise OneIterError(f"replay '{ref.path.name}' holds the state its {name} had at this step, and this replay was "
                       f"given no optimizer to load it into: pass optimizer= (the one that steps this iteration)",
                       param="optimizer")


def _forward_autocast(options: RecordOptions, cast) -> RecordOptions:
    """accelerate's mixed-precision forward enters its own autocast: the recording's `amp` is its dtype, and the
    Recorder does not enter another."""
    amp = amp_name(str(cast.dtype)) if cast.dtype is not None else None
    if options.amp is not None and amp is not None and options.amp != amp:
        raise OneIterError(f"amp is {options.amp!r}, but the model's forward (accelerate's mixed precision) autocasts "
                           f"to {AMP_DTYPES[amp]}: give amp={amp!r}, or leave amp out", param="amp")
    return replace(options, amp=options.amp or amp, manage_autocast=False)


def _check_world_size(ref, info) -> None:
    """A multi-rank reference is replayed with as many ranks (DDP averages gradients over all of them); one of its
    ranks replayed by a single process is allowed, with a warning (debugging one rank)."""
    theirs = int(ref.meta.get("world_size") or 1)
    if theirs <= 1 or theirs == info.world_size:
        return
    if info.distributed:
        raise OneIterError(f"replay {ref.path.name} was recorded with {theirs} ranks, this run has "
                           f"{info.world_size}: run torchrun with --nproc-per-node {theirs}", param="replay")
    warn(f"replaying one rank of a {theirs}-rank run in a single process: forward and backward compare as usual, "
         f"but param_grads and updated weights are not averaged and will differ", stacklevel=2)


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def _check_space(out: Path, needed: int, how: str, written: int = 0) -> None:
    """Refuse when the filesystem of `out` has less free space than `needed` more bytes."""
    try:
        free = shutil.disk_usage(out.parent).free
    except OSError:
        return
    if free < needed:
        raise OneIterError(f"out '{out}' needs {how} {_size(needed + written)}, and '{out.parent}' has "
                           f"{_size(free + written)} free: free space, write elsewhere, or record less "
                           f"(include/exclude)", param="out")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _device_of(model):
    import torch

    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _param_dtype(model):
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def _amp_dtype(amp: str | None):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")
