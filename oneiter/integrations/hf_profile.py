"""Hugging Face `transformers`: `ProfileCallback`, a `Trainer`'s own steps under `oneiter profile`'s profiler.

    from oneiter.integrations.hf import ProfileCallback

    Trainer(model, args, train_dataset=ds, callbacks=[ProfileCallback(schedule="wait=1,warmup=1,active=2",
                                                                     out_dir="prof")]).train()

Where it sits: re-exported by `hf.py`; the events go to `profile_callback.ProfileEvents` (shared with Lightning's).
A step is `on_step_begin` to `on_step_end`: forward, backward, clipping and the optimizer step of one batch
(`gradient_accumulation_steps` batches with accumulation). Schedule step 0 is the first step of this `train()`
(`first_step` in summary.json: nonzero after a resume). The default folder is `<output_dir>/oneiter_profile`.
The Trainer calls no callback when training raises: the profiler then stays on until the process ends.
"""

from __future__ import annotations

from transformers import TrainerCallback

from oneiter.integrations.profile_callback import ProfileEvents

__all__ = ["ProfileCallback"]


class ProfileCallback(ProfileEvents, TrainerCallback):
    __doc__ = ProfileEvents.__doc__
    FRAMEWORK = "transformers"

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import transformers

        self._start(model, optimizer, default_dir=args.output_dir, batch_size=args.per_device_train_batch_size,
                    seed=args.seed, amp="bf16" if args.bf16 else ("fp16" if args.fp16 else None),
                    remaining=(state.max_steps - state.global_step) if state.max_steps else None,
                    first_step=state.global_step, version=str(transformers.__version__))

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        self._end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self._end_run()
