"""Hugging Face `transformers`: a `TrainerCallback` that records one optimizer step of a `Trainer` run.

    from oneiter.integrations.hf import OneIterCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[OneIterCallback(step=2, out="ref.h5")])
    trainer.train()                                           # reference: writes ref.h5 at step 2
    ...callbacks=[OneIterCallback(step=2, out="npu.h5", replay="ref.h5")]   # target: same weights and batch

Where it sits: an adapter, like the mmengine hook, on the pattern of `integrations/recording.py` (its settings are
one `RecordOptions`: `options=`, or the `oneiter.Recorder` keywords). The step is recorded by an `oneiter.Recorder`
opened in `on_step_begin` of step `step` (0-based: `state.global_step` when the step begins) and closed in
`on_step_end`, so the file reads, compares and replays like one `oneiter record` writes. What the Recorder takes
from the Trainer:

- the batch is the keyword arguments of the model's first forward call (`input_ids`, `attention_mask`,
  `labels`, ...), named `kwarg.<name>`; with `replay=` the reference's tensors are put in their place;
- the loss is the tensor the Trainer's backward runs on (divided by the accumulation steps when there are any);
- parameter gradients are read when that backward returns, *before* the Trainer's gradient clipping (which then
  changes them in place: the optimizer's update is reported as not judged by the per-call probe, with that
  reason, and the accumulated comparison of the updated weights still runs);
- autocast (`bf16=True` / `fp16=True`) is the Trainer's own; the Recorder notes its dtype. accelerate also casts
  the model's outputs to float32 after the model returns them; for the recorded step the callback takes that cast
  off (`_own_outputs`), so the model's own outputs are recorded, as in a float32 run.

The optimizer's state when the step begins (AdamW's moments and step count) is in the file, and a replay loads it
(`record/start/optimizer_start.py`): a step after the first replays from the reference's state, its update judged.

`every=K` instead of `step=N` records the statistics of every K-th optimizer step (0, K, 2K, ...) into one
multi-step file (`record/steps/step_recorder.py`: per step every tensor's statistics, the batch and random values, the
loss, gradient and update norms); with `replay=` of such a file, the target's run takes the reference's batch and random
values at those steps and starts from its state at the first. `oneiter compare` names the first recorded step
that leaves the tolerance (these files have no twin to measure a band: docs/steps.md), and how to record it.

Limits: `gradient_accumulation_steps` must be 1 (a replay swaps the batch of one forward call). If the recorded
step raises, the Trainer calls no callback: `close()` (or the end of training) removes the hooks and the temporary
file.
"""

from __future__ import annotations

import os
from types import MethodType
from typing import Any, Callable, Optional

try:
    from transformers import TrainerCallback
except ImportError as _err:  # transformers is optional for oneiter, required here
    raise ImportError(
        f"oneiter.integrations.hf needs transformers ({_err}); install it with `pip install transformers`"
    ) from _err

from oneiter.errors import OneIterError
from oneiter.integrations.recording import for_step, open_steps, settings
from oneiter.record.options import RecordOptions
from oneiter.record.recorder import Recorder, RecordSummary
from oneiter.record.session import check_output
from oneiter.record.steps.step_recorder import StepRecorder
from oneiter.runtime.distributed import current_rank, rank_path

__all__ = ["OneIterCallback"]



class OneIterCallback(TrainerCallback):
    """Record optimizer step `step` (0-based) of a `Trainer` run into `out` (reference, or replay of `replay`), or the
    statistics of every `every`-th step (0, K, 2K, ...: a multi-step file).

    Args:
        step / every: the step to record in full, or every K-th step's statistics (one of them).
        options: the recording's settings, a `oneiter.record.options.RecordOptions` (`out`, `replay`, ...).
        **record: or the same settings as keywords, those `oneiter.Recorder` takes: `out` (required), `replay`,
            `include`/`exclude` (regexes on module paths), `seed` (`torch.manual_seed` when the step begins; None
            leaves the RNG alone), `isolate` (with `replay`: judge every call on the reference's values), `force`
            (overwrite `out`), `level`, ...; `model_name` is the file's `model`. Not `amp`: the Trainer's
            `bf16`/`fp16` decide it (`integrations/recording.py`).

    After the step (or the run, with `every`), `summary` holds what was written.
    """

    def __init__(
        self,
        *,
        step: Optional[int] = None,
        every: Optional[int] = None,
        options: Optional[RecordOptions] = None,
        **record: Any,
    ):
        if (step is None) == (every is None):
            raise OneIterError("give step (one step, in full) or every (the statistics of every K-th step), not "
                               f"{'both' if step is not None else 'neither'}", param="step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise OneIterError(f"step must be a non-negative int, got {step!r}", param="step")
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise OneIterError(f"every must be an int >= 1, got {every!r}", param="every")
        if "out" in record and not isinstance(record["out"], (str, os.PathLike)):
            raise OneIterError(f"out must be a file path, got {record['out']!r}", param="out")
        self.step, self.every = step, every
        # the Trainer enters autocast itself; its dtype is known when the step begins (`on_step_begin`)
        self.options = settings(type(self).__name__, options, record)
        self.out, self.replay = self.options.out, self.options.replay
        if self.replay is not None and not self.replay.is_file():
            raise OneIterError(f"replay must be an existing recording (.h5), got '{self.replay}'", param="replay")
        self.summary: Optional[RecordSummary] = None
        self._recorder: Optional[Recorder] = None
        self._steps: Optional[StepRecorder] = None  # `every`: the multi-step recording of the run
        self._block = None  # `every`: the step being recorded (its `StepRecorder.step` block)
        self._restore_forward: Optional[Callable[[], None]] = None
        self._check_out()

    def _check_out(self) -> None:
        info = current_rank()
        check_output(rank_path(self.out, info.rank, info.world_size), self.options.force)

    # -- Trainer events --------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if args.gradient_accumulation_steps != 1:
            raise OneIterError(f"gradient_accumulation_steps must be 1 to record a step (a replay swaps the batch of "
                               f"one forward call), got {args.gradient_accumulation_steps}",
                               param="gradient_accumulation_steps")
        if self.step is not None and state.max_steps and self.step >= state.max_steps:
            raise OneIterError(f"step must be below the run's {state.max_steps} steps, got {self.step}: nothing "
                               f"would be recorded", param="step")
        self._check_out()
        if self.every is not None:
            self._open_steps(args, state, kwargs.get("model"), kwargs.get("optimizer"))

    def _open_steps(self, args, state, model, optimizer) -> None:
        """`every`: the multi-step recording of the run's steps 0, K, 2K, ... below max_steps (a replay: the
        reference's)."""
        self._steps = open_steps(model, self.options, every=self.every, max_steps=state.max_steps,
                                 optimizer=_torch_optimizer(optimizer), amp=_amp(args), meta=_meta(args, None))

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._steps is not None:
            self._begin_every(state.global_step, model)
            return
        if state.global_step != self.step or self.summary is not None or self._recorder is not None:
            return
        options = for_step(self.options, amp=_amp(args), meta=_meta(args, self.step))
        self._recorder = self._enter(Recorder.from_options(model, options, optimizer=_torch_optimizer(optimizer)),
                                     model)

    def _begin_every(self, step: int, model) -> None:
        if self._steps.next_step == step:
            self._block = self._enter(self._steps.step(step), model)

    def _enter(self, context, model):
        """Enter the recording of one step (a Recorder, or a step of the multi-step file) with the model's own
        outputs recorded; returns it. On failure the forward is put back and the exception goes on."""
        self._restore_forward = _own_outputs(model)
        try:
            context.__enter__()
        except BaseException:
            self._put_forward_back()
            raise
        return context

    def _leave(self, context) -> None:
        try:
            context.__exit__(None, None, None)
        finally:
            self._put_forward_back()

    def on_step_end(self, args, state, control, **kwargs):
        block, self._block = self._block, None
        if block is not None:
            self._leave(block)
            return
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            self._leave(recorder)
            self.summary = recorder.summary

    def on_train_end(self, args, state, control, **kwargs):
        if self._steps is not None and self._block is None:  # the run ended: the multi-step file is complete
            steps, self._steps = self._steps, None
            steps.__exit__(None, None, None)
            self.summary = steps.summary
        self.close()

    def close(self) -> None:
        """Abandon a step that did not end (the Trainer raised inside it): hooks removed, no file left."""
        block, self._block = self._block, None
        if block is not None:
            try:
                block.__exit__(RuntimeError, RuntimeError("the recorded step did not end"), None)
            finally:
                self._put_forward_back()
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.__exit__(RuntimeError, RuntimeError("the recorded run did not end"), None)
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            try:
                recorder.__exit__(RuntimeError, RuntimeError("the recorded step did not end"), None)
            finally:
                self._put_forward_back()

    def _put_forward_back(self) -> None:
        restore, self._restore_forward = self._restore_forward, None
        if restore is not None:
            restore()


def _own_outputs(model) -> Optional[Callable[[], None]]:
    """Under `bf16=True`/`fp16=True` accelerate replaces `model.forward` by autocast plus `convert_outputs_to_fp32`:
    the module's hooks then see float32 *copies* of its outputs, made after its own code returned them. A model that
    returns the loss and the logits it computed it from then returns logits no gradient reaches (the loss used the
    originals), where a float32 run returns the very logits the loss used: the two recordings would not hold the
    same gradients. For the recorded step the model's forward is accelerate's autocast alone (the loss is float32
    either way; the Trainer reads only the loss during training); returns what puts the wrapper back (None: there
    is none)."""
    forward = model.__dict__.get("forward")
    if forward is None:
        return None
    convert = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    inner = getattr(convert, "model_forward", None)  # accelerate's ConvertOutputsToFp32 keeps what it wraps here
    if type(convert).__name__ != "ConvertOutputsToFp32" or inner is None:
        return None
    model.forward = MethodType(inner, model) if isinstance(forward, MethodType) else inner

    def restore() -> None:
        model.forward = forward

    return restore


def _torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (its step calls the inner one's)."""
    return getattr(optimizer, "optimizer", optimizer)


def _amp(args) -> str | None:
    """The autocast the Trainer's arguments ask for."""
    return "bf16" if args.bf16 else ("fp16" if args.fp16 else None)


def _meta(args, step: Optional[int]) -> dict[str, Any]:
    import transformers

    return {
        "batch_size": int(args.per_device_train_batch_size), "seed": int(args.seed),
        **({"iteration": step} if step is not None else {}),
        "framework": "transformers", "transformers_version": str(transformers.__version__),
    }
