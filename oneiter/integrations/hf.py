"""Hugging Face `transformers`: a `TrainerCallback` that records one optimizer step of a `Trainer` run (and, from
`hf_profile.py`, `ProfileCallback`, which profiles its steps).

    from oneiter.integrations.hf import OneIterCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[OneIterCallback(step=2, out="ref.h5")])
    trainer.train()                                           # reference: writes ref.h5 at step 2
    ...callbacks=[OneIterCallback(step=2, out="npu.h5", replay="ref.h5")]   # target: same weights and batch

Where it sits: an adapter, like the mmengine hook and the Lightning callback, with which it shares its driver
(`step_driver.py`). The step is recorded by an `oneiter.Recorder` opened in
`on_step_begin` of step `step` (0-based: `state.global_step` when the step begins) and closed in `on_step_end`,
so the file reads, compares and replays like one `oneiter record` writes. What the Recorder takes from the Trainer:

- the batch is the keyword arguments of the model's first forward call (`input_ids`, `attention_mask`,
  `labels`, ...), named `kwarg.<name>`; with `replay=` the reference's tensors are put in their place;
- the loss is the tensor the Trainer's backward runs on (divided by the accumulation steps when there are any);
- gradient accumulation (`gradient_accumulation_steps=K`): the step's K microbatches, each its own forward and
  backward, are one recording (docs/format.md "Microbatches"): each forward call takes its microbatch's batch (with
  `num_items_in_batch`, the step's label count, among its keyword arguments);
- parameter gradients are read when the last backward returns, *before* the Trainer's gradient clipping (which
  then changes them in place: the optimizer's update is reported as not judged by the per-call probe, with that
  reason, and the accumulated comparison of the updated weights still runs);
- autocast (`bf16=True` / `fp16=True`) is the Trainer's own; the Recorder notes its dtype. accelerate also casts
  the model's outputs to float32 after the model returns them; for the recorded step the Recorder takes that cast
  off (`runtime/wrappers.py`), so the model's own outputs are recorded, as in a float32 run.

The optimizer's state when the step begins (AdamW's moments and step count) is in the file, and a replay loads it
(`record/start/optimizer_start.py`): a step after the first replays from the reference's state, its update judged.

`every=K` instead of `step=N` records the statistics of every K-th optimizer step (0, K, 2K, ...) into one
multi-step file (`record/steps/step_recorder.py`: per step every tensor's statistics, the batch and random values, the
loss, gradient and update norms); with `replay=` of such a file, the target's run takes the reference's batch and random
values at those steps and starts from its state at the first. `oneiter compare` names the first recorded step
that leaves the tolerance (these files have no twin to measure a band: docs/steps.md), and how to record it.

`torch_compile=True`: the model the Trainer calls is accelerate's `torch.compile(model)`; the callback records that
compiled model (one block, `(root)`: `docs/compiled.md`), and from `on_train_begin` on, before it first compiles,
inductor draws its random numbers through the aten ops a replay hands the reference's (`fallback_random`), so a
compiled GPT-2 with dropout replays an eager reference.

Under torchrun the Trainer never destroys the process group accelerate made for it, and a gloo run may then abort
as the process ends (`terminate called without an active exception`, exit -6, after a run that succeeded: the
Trainer's own race with Python's shutdown, without oneiter too); the callback has the group destroyed at exit,
before Python finalizes (`runtime/distributed.py`: `destroy_at_exit`).

If the recorded step raises, the Trainer calls no callback: `close()` (or the end of training) removes the hooks
and the temporary file.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

try:
    from transformers import TrainerCallback
except ImportError as _err:  # transformers is optional for oneiter, required here
    raise ImportError(
        f"oneiter.integrations.hf needs transformers ({_err}); install it with `pip install transformers`"
    ) from _err

from oneiter.integrations.hf_profile import ProfileCallback
from oneiter.integrations.step_driver import DrivenCallback, meta_of
from oneiter.record.options import Amp, RecordOptions
from oneiter.runtime.distributed import current_rank, destroy_at_exit
from oneiter.runtime.wrappers import compiled_wrapper

__all__ = ["OneIterCallback", "ProfileCallback"]


class OneIterCallback(DrivenCallback, TrainerCallback):
    """Record optimizer step `step` (0-based) of a `Trainer` run into `out` (reference, or replay of `replay`), or the
    statistics of every `every`-th step (0, K, 2K, ...: a multi-step file).

    Its arguments and `summary`: `step_driver.DrivenCallback`, shared with the Lightning callback.
    """

    # -- Trainer events --------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._driver.check_steps(state.max_steps)
        # with torch_compile=True the Trainer calls accelerate's torch.compile(model): the compiled model is recorded
        self._model = compiled_wrapper(model) if args.torch_compile and model is not None else model
        self._driver.start_run(self._model, optimizer, self._options(args, None), state.max_steps)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        model = model if getattr(self, "_model", None) is None else self._model
        self._driver.begin(state.global_step, model, optimizer, lambda: self._options(args, state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self._driver.end()

    def on_train_end(self, args, state, control, **kwargs):
        self._driver.end_run()
        self.close()
        if current_rank().distributed:  # the Trainer never destroys its process group: at exit, before Python
            destroy_at_exit()  # finalizes (`runtime/distributed.py`: else gloo may abort the process as it ends)

    def close(self) -> None:
        """Abandon a step that did not end (the Trainer raised inside it): hooks removed, no file left."""
        self._model = None
        self._driver.close()

    def _options(self, args, step: Optional[int]) -> RecordOptions:
        """The recording's options with what the Trainer's arguments say: its autocast, batch size and seed."""
        import transformers

        amp: Amp | None = "bf16" if args.bf16 else ("fp16" if args.fp16 else None)
        meta = meta_of("transformers", str(transformers.__version__), step,
                       batch_size=int(args.per_device_train_batch_size), seed=int(args.seed))
        return replace(self.options, amp=amp, meta={**self.options.meta, **meta})
