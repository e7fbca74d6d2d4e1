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

import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.optimizer_state import NOT_RECORDED
from oneiter.format.schema import GRAD_REDUCTION, MICROBATCHES
from oneiter.record.capture.batch import BatchSwap, batch_rows
from oneiter.record.capture.blocks import compiled_attr, compiled_notes, refuse
from oneiter.record.capture.hooks import unscaled
from oneiter.record.capture.optimizer_step import before_update
from oneiter.record.loop.attrs import file_attrs
from oneiter.record.loop.entry import load_reference, probe_factory, stats_groups
from oneiter.record.loop.flow import IterationFlow
from oneiter.record.loop.given import device_of, forward_autocast, model_of, optimizer_list, param_dtype
from oneiter.record.loop.phases import Phase, never_called
from oneiter.record.loop.space import check_room, forward_done
from oneiter.record.modes.active import ActiveModes
from oneiter.record.modes.float8 import convert as convert_float8
from oneiter.record.options import (
    CALIBRATIONS,
    LEVELS,
    RecordOptions,
    keyword_signature,
    module_selector,
    options_from,
    regex_list,
)
from oneiter.record.session import RecordingSession, atomic_output, check_output
from oneiter.record.start.optimizer_start import start_entries
from oneiter.runtime import precision_modes
from oneiter.runtime.compiled import CompileWatch, compile_modules, eager_name, outside_call, recordable_compiles
from oneiter.runtime.distributed import current_rank, rank_path, replay_path
from oneiter.runtime.host_random import seed_all
from oneiter.runtime.sharding import is_sharded, reduction
from oneiter.runtime.wrappers import accumulation_steps, grad_scalers, model_forward_cast

if TYPE_CHECKING:
    import torch

    from oneiter.record.impact.start import Start

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


class Recorder:
    """Record the training iteration run inside the `with` block into the HDF5 file `out`.

    Args:
        model: the live `nn.Module` (the inner module under DDP: its names are the recording's names; a model
            sharded with FSDP2's `fully_shard` as it is).
        out: the `.h5` file to write; never overwritten unless `force=True`.
        optimizer: the optimizer (or a list of them) that steps this iteration, or None.
        progress: `progress(phase, num_tensors)` after each captured tensor.
        notify: `notify(message)` for one-line notes while recording (the size estimate once forward is done).
        **options: the recording's settings, each a field of `oneiter.record.options.RecordOptions`, where each is
            documented (`replay`, `amp`, `include` / `exclude`, `seed`, `isolate`, `calibrate`, `against`, `level`,
            `compile`, `float8`, `impact`, ...); `inspect.signature(Recorder)` lists them with their defaults.

    `out` and the settings become one checked `RecordOptions` (`self.options`); `Recorder.from_options` takes one
    built beforehand. The block's progress is one `Phase` (`self.phase`). Several consecutive iterations into one
    file: `oneiter.StepRecorder`, which takes the same keywords and `steps=N` (`record/steps/step_recorder.py`).
    """

    def __init__(self, model, out: str | os.PathLike, *, optimizer=None,
                 progress: Callable[[str, int], None] | None = None, notify: Callable[[str], None] | None = None,
                 **options: Any):
        model = model_of(model)
        self._setup(model, options_from("Recorder", out, options), optimizer, progress, notify)

    @classmethod
    def from_options(cls, model, options: RecordOptions, *, optimizer=None,
                     progress: Callable[[str, int], None] | None = None,
                     notify: Callable[[str], None] | None = None, reference=None, start: bool = True,
                     step_of: bool = False) -> "Recorder":
        """A Recorder of `options` (built, and so checked, beforehand: what `record()` and the integrations use).

        For one step of a multi-step recording (`record/steps/step_recorder.py`): `reference` is the open reference
        iteration to replay (a step of a multi-step reference) instead of opening `options.replay`, and `start=False`
        records an iteration that continues the run: a replay loads no weights or optimizer state, and a reference keeps
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
        _check_selects(model, options, self._select)
        self._forward_cast = model_forward_cast(model)  # accelerate's mixed precision: the recording's autocast
        if self._forward_cast is not None:
            self.options = options = forward_autocast(options, self._forward_cast)
        self.optimizers = optimizer_list(optimizer)
        self._scalers = grad_scalers(optimizer)  # accelerate's AcceleratedOptimizer steps through its GradScaler
        # what its wrapper says it accumulates over (the errors); the iteration's phases, microbatches, gradients
        self._flow = IterationFlow(model, options, accumulation_steps(optimizer), stepped=bool(self.optimizers))
        self.progress, self.notify = progress, notify
        self.estimated_bytes: int | None = None  # the whole file, estimated once forward is done
        self.rank = current_rank()
        self.out, self.replay = options.out, options.replay
        if self.rank.distributed:
            self.out = rank_path(self.out, self.rank.rank, self.rank.world_size)
            self.replay = replay_path(self.replay, self.rank) if self.replay is not None else None
        self.summary: RecordSummary | None = None
        self._stack: ExitStack | None = None
        self.session: RecordingSession | None = None  # with its modes and compile watch: the block's, while it runs
        self._modes: ActiveModes | None = None
        self._watch: CompileWatch | None = None
        self._loss: torch.Tensor | None = None  # the iteration's loss, once the block ends
        self._swap: list[BatchSwap] | None = None  # a replay: the reference's batch of each microbatch
        self._given_ref, self._start = None, True  # `from_options`: a step of a multi-step recording
        self._step_of = False
        self.optimizer_start = ""  # the file's `optimizer_state` (format/optimizer_state.py), set on enter
        self._meta_batch_size = 0  # the batch size the file's attributes state (0: its batch's rows, once taken)
        self._iteration: Callable[[], Any] | None = None  # `run(fn)`'s fn: what `impact` runs again
        self._impact_start: Start | None = None  # `impact`: the iteration's start (`record/impact/start.py`)
        self._pass = None  # the impact run in progress: `inputs`, `loss` and `note` are its
        if options.impact and self.rank.distributed:
            raise OneIterError("impact runs the iteration again in one process: record without torchrun",
                               param="impact")

    @property
    def phase(self) -> Phase:
        """Where the iteration is (`record/loop/phases.py`)."""
        return self._flow.phase

    @property
    def num_microbatches(self) -> int:
        """How many microbatches of the iteration have begun (each `rec.inputs`, or the model's call after a
        backward: docs/format.md "Microbatches")."""
        return self._flow.mb.count

    # -- the block ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        if self.phase is not Phase.IDLE:
            raise OneIterError("a Recorder records one block: make a new one for another iteration", param="model")
        self._check_entry()
        self._started = time.perf_counter()
        stack = ExitStack()
        try:
            self._open(stack)
            self._attach(stack)
        except BaseException:
            stack.__exit__(*sys.exc_info())  # with the exception: atomic_output deletes, never renames
            raise
        self._stack = stack
        self._flow.advance(Phase.OPEN)
        for scaler in self._scalers:
            self.loss_scale(scaler)
        assert self.session is not None  # `_open` made it
        self.session.enter_phase("forward")
        return self

    def _check_entry(self) -> None:
        """What refuses the block before anything changes: the output (and its filesystem's free space)."""
        opts = self.options
        if opts.impact_from is not None:
            raise OneIterError("impact_from names the calls to fix at every step of a multi-step replay; a replay of "
                               "one iteration fixes the calls it flags itself: drop impact_from", param="impact_from")
        check_output(self.out, opts.force)
        self._state_bytes = check_room(self.out, self.replay, self.model, opts.level)

    def _open(self, stack: ExitStack) -> None:
        """The model as the block records it (float8, compiled, the reference's weights), the session writing the
        temporary file, its `state_before` and optimizer state, the seeded generators; each undone by `stack`."""
        opts = self.options
        # float8 first: hooks, compilation and the reference's weights see it; each returns its undo
        stack.callback(convert_float8(self.model, opts.float8) if opts.float8 else lambda: None)
        stack.callback(compile_modules(self.model, opts.compile, opts.compile_modules) if opts.compile
                       else lambda: None)
        self.ref = self._given_ref if self._given_ref is not None else (
            stack.enter_context(IterationFile(self.replay)) if self.replay is not None else None)
        self.device = device_of(self.model)
        # the reduced-precision flags in force (TF32...): in the file, and reproduced by the calibration
        self.precision_modes = precision_modes.current(self.device.type)
        if self.ref is not None:
            self._swap, loaded = load_reference(self.ref, self.model, self.optimizers, self.rank, self._start)
            self.optimizer_start = self.optimizer_start if loaded is None else loaded
        # the optimizer's state as the step begins (after a replay loaded the reference's): in the file
        opt_entries, stored = start_entries(self.optimizers, self.model)
        if self.ref is None or not self._start:
            self.optimizer_start = stored  # a reference (or a run continuing): what its optimizer holds
        elif NOT_RECORDED in (stored, self.optimizer_start):  # a replay's start that cannot be stored
            opt_entries, self.optimizer_start = [], NOT_RECORDED
        tmp = stack.enter_context(atomic_output(self.out, opts.force))
        self.session = stack.enter_context(self._session(tmp))
        # a replay numbers each module's calls as its reference did (`hooks.pair_with`)
        self.session.bind_block(self.ref.calls() if self.ref is not None else None, self.optimizers,
                                self.optimizer_start)
        self.session.state_before()
        self.session.optimizer_state(opt_entries)
        del opt_entries
        self._before_bytes = self.session.sink.num_bytes
        if opts.seed is not None:
            seed_all(opts.seed)  # torch's, Python's and numpy's generators
        if opts.impact:
            from oneiter.record.impact.start import Start  # imports torch

            self._impact_start = Start(self.model, self.optimizers)

    def _session(self, tmp: Path) -> RecordingSession:
        """The session that writes the block's temporary file, with the probe that reruns each call."""
        opts = self.options
        factory, self.local_kind = probe_factory(opts, self.ref, self.model, self.device, self.precision_modes,
                                                 None if self._step_of else self.notify)
        attrs = file_attrs(self.model, opts, ref=self.ref, device=self.device, optimizers=self.optimizers,
                           optimizer_start=self.optimizer_start, rank=self.rank, modes=self.precision_modes,
                           replay=self.replay, local_kind=self.local_kind)
        self._meta_batch_size = int(attrs.get("batch_size") or 0)
        return RecordingSession(
            self.model, tmp, attrs, select=self._select, progress=self.progress, probe_factory=factory,
            keep_values=self.local_kind == "against_cpu",
            stats_groups=stats_groups(self.ref, self._start) if opts.level == "stats" else None,
            queue_bytes=opts.queue_bytes,
        )

    def _attach(self, stack: ExitStack) -> None:
        """The modes, hooks and patches of the block, each undone by `stack`."""
        flow = self._flow
        opts = self.options
        assert self.session is not None  # `_open` made it
        self._modes = ActiveModes(self.session.sink, self.ref, self.device, opts.random_replay, opts.fallback,
                                  self.session.module_capture, self.session.live_collective, flow.on_chunk,
                                  flow.on_scaled)
        self.session.attach_modes(self._modes, sharded=is_sharded(self.model))
        flow.bind(self.session, self._modes, self.device, self._take_batch, self._estimate,
                  swapped=self._swap is not None)
        if self._forward_cast is not None:  # the model's own outputs, not accelerate's float32 copies of them
            stack.callback(self._forward_cast.uncast())
        capture = stack.enter_context(self.session.capture())
        refuse(capture.blocks, fallback=bool(opts.fallback), ref=self.ref)
        if capture.blocks:  # compiled code draws random numbers the random modes see (`runtime/compiled.py`)
            stack.enter_context(recordable_compiles())
        self._watch = stack.enter_context(CompileWatch(capture.open_block, capture.is_suspended))
        stack.enter_context(self._modes)
        stack.callback(self._remove_hooks)
        self._hooks = outside_call(self.model, flow.first_forward, prepend=True)
        self._hooks += [before_update(opt, flow.before_step) for opt in self.optimizers]
        flow.patch_backward(stack)
        flow.enter_autocast()
        stack.callback(flow.end_autocast)

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            self._finish(stack, exc_type, exc, tb)
        finally:
            self._flow.advance(Phase.CLOSED)
            # what the block needed (the session, its probe's caches of reference tensors, the random modes,
            # the open reference) goes now: a loop that records again must not hold the previous recording's
            self.session = self._modes = self.ref = self._swap = self._watch = None
            self._impact_start = self._iteration = None
            self._flow.release()

    def _finish(self, stack: ExitStack, exc_type, exc, tb) -> None:
        flow = self._flow
        flow.end_autocast()
        if exc_type is not None:  # every hook removed; atomic_output deletes the temporary file
            stack.__exit__(exc_type, exc, tb)
            return
        with stack:
            self._remove_hooks()
            if not flow.mb.has_backward():
                raise OneIterError("the Recorder block ended before any backward ran, so it holds no training "
                                   "iteration: run the loss's backward (and the optimizer's step) inside the `with` "
                                   "block, or name the loss with rec.loss(tensor)", param="model")
            if self.phase is Phase.OPEN:
                raise never_called()
            flow.mb.check_replayed(self._swap, self.ref.path.name if self.ref is not None else "")
            flow.settle_grads()
            impact = self._write_end()
        self._summarise(impact)

    def _write_end(self) -> dict:
        """What the block writes when it ends: state_after, the loss (and each microbatch's), the impact runs, the
        modes' and compilation's attributes, the `/local` table; returns what the impact runs took."""
        flow, session, modes, watch = self._flow, self.session, self._modes, self._watch
        assert session is not None and modes is not None and watch is not None  # the block ran to its end
        session.enter_phase("writing")
        session.state_after()
        # the tensor each backward ran on: the loss times the GradScaler's scale
        losses = flow.mb.values(lambda t: unscaled(t, session.module_capture.grad_scale))
        self._loss = flow.mb.total(losses)
        if flow.mb.count > 1:
            session.microbatch_losses(flow.mb.as_floats(losses))
            session.extra_attrs[MICROBATCHES] = flow.mb.count
        impact = self._measure_impact() if self.options.impact else {}
        reduced = reduction(self.model, self.rank.world_size, modes.reduced_grads())
        watch.__exit__(None, None, None)  # before the attribute that says what it saw is written
        compiled = compiled_attr(session.module_capture.blocks, watch, modes.random.num_compiled)
        self._counts = session.finish(self._loss, {**modes.summary(), GRAD_REDUCTION: reduced, **compiled})
        for line in compiled_notes(compiled) if self.notify is not None and not self._step_of else ():
            self.notify(line)
        return impact

    def _summarise(self, impact: dict) -> None:
        assert self._watch is not None and self.session is not None and self._loss is not None  # `_write_end` ran
        compiling, counts = self._watch.total_seconds, self._counts
        self.summary = RecordSummary(
            self.out, counts[0], counts[1], self.out.stat().st_size, time.perf_counter() - self._started - compiling,
            float(self._loss.float()), self.session.module_capture.num_calls, compile_seconds=compiling,
        )
        self.summary.iteration_seconds = self.summary.seconds
        if impact:
            self.summary.impact_runs, self.summary.impact_seconds = impact["runs"], impact["seconds"]

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
        from oneiter.record.impact.recorded import measure_block  # imports torch

        if self._iteration is None:
            raise _no_iteration()
        assert self._loss is not None  # `_write_end` took it
        return measure_block(self.model, self.ref, self.options, self.device, self.optimizers,
                             loss=float(self._loss.float()), session=self.session, start=self._impact_start,
                             modes=self.precision_modes, dtype=param_dtype(self.model), progress=self.progress,
                             run_again=self._impact_run)

    def _impact_run(self, step) -> None:
        """One impact run: the iteration again, `step` (an `ImpactPass`) handing out its batch and taking its loss."""
        self._pass = step
        assert self._iteration is not None  # `_measure_impact` checked it
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
        if not self._flow.begin_microbatch():
            raise OneIterError("rec.inputs() after the optimizer's step: a Recorder block records one iteration, "
                               "its microbatches before its step; record the next one in a new block",
                               param="inputs")
        self._flow.mb.from_inputs = True
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
        mb = self._flow.mb
        mb.note_loss(mb.current, tensor.detach(), explicit=True)
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
        assert self.session is not None  # the block runs
        self.session.module_capture.grad_scale = value
        self.session.extra_attrs["loss_scale"] = value

    def note(self, **attrs) -> None:
        """Extra root attributes for the file (JSON-able values), written when the block ends."""
        if self._pass is not None:
            return
        self._active("note")
        assert self.session is not None  # the block runs
        self.session.extra_attrs.update(attrs)

    def locate(self, exc: BaseException, frame: tuple[str, int, str] | None) -> tuple[str, str] | None:
        """Where in the model an exception of this block was raised: (what, where) — `the forward of
        layers.1.mlp@0`, `at file.py:31, in forward` — or None when it cannot say (`errors.user_code`'s
        `locate`; `record/capture/raised_at.py` finds it). Call it inside the block, before the exception leaves it."""
        if self._stack is None or self._pass is not None:
            return None
        return self._flow.locate(exc, frame)

    # -- internals ---------------------------------------------------------------------------------------------------
    def _active(self, what: str) -> None:
        if self._stack is None:
            raise OneIterError(f"rec.{what}() works only inside `with Recorder(...) as rec:`", param=what)

    def _take_batch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The batch of the microbatch that just began: stored, and on replay the reference's in its place."""
        if self.options.impact and self._iteration is None:  # refused before the iteration and its probes run
            raise _no_iteration()
        mb = self._flow.mb
        assert self.session is not None  # the block runs
        args, kwargs = mb.take(self.session.sink, args, kwargs, self._swap,
                               self.ref.path.name if self.ref is not None else "")
        if not self._meta_batch_size and mb.current == 0:  # nothing said how large: its first tensor's rows
            rows = batch_rows(args, kwargs)
            if rows:
                self.session.extra_attrs.setdefault("batch_size", rows)
        return args, kwargs

    def _estimate(self) -> None:
        """Forward is done (the block's first backward begins): the file's size estimated, and checked."""
        assert self.session is not None  # the block runs
        self.estimated_bytes = forward_done(self.out, self.session.sink.num_bytes, self._before_bytes,
                                            self._state_bytes, None if self._step_of else self.notify)

    def _remove_hooks(self) -> None:
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._hooks = []


# help() and inspect.signature list every RecordOptions field (mypy: a function has no __signature__ attribute)
Recorder.__init__.__signature__ = keyword_signature(Recorder.__init__)  # type: ignore[attr-defined]


def _check_selects(model, options: RecordOptions, select: Callable[[str], bool]) -> None:
    """`include` / `exclude` leave at least one module of the model to record."""
    paths = [eager_name(p) for p, _ in model.named_modules()]
    if (options.include or options.exclude) and not any(select(p) for p in paths):
        first = next((p for p in paths if p), "(root)")
        raise OneIterError(f"include {options.include} / exclude {options.exclude} leave no module of the model "
                           f"to record (module paths look like '{first}')", param="include")


def _no_iteration() -> OneIterError:
    return OneIterError("impact runs the iteration again from its start: give it as a function, rec.run(fn), inside "
                        "the block", param="impact")
