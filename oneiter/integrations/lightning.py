"""PyTorch Lightning: a `Callback` that records one optimizer step of a `Trainer.fit` run, and one that profiles it
(`ProfileCallback`: what `oneiter profile` writes, for Lightning's own steps; `profile_callback.py`).

    from oneiter.integrations.lightning import OneIterCallback

    trainer = L.Trainer(max_steps=4, callbacks=[OneIterCallback(step=2, out="ref.h5")])   # reference
    trainer = L.Trainer(max_steps=4, precision="bf16-mixed",
                        callbacks=[OneIterCallback(step=2, out="bf16.h5", replay="ref.h5")])  # target

Where it sits: an adapter, like the Hugging Face callback, with which it shares its driver (`step_driver.py`): an
`oneiter.Recorder` is opened in `on_train_batch_start` of step `step` (0-based `trainer.global_step`, the optimizer
steps taken so far) and closed in `on_train_batch_end`, so the file reads, compares and replays like one `oneiter
record` writes. What the Recorder takes from Lightning:

- the batch is what `training_step` is called with (after `transfer_batch_to_device` and the precision plugin's
  input cast), names `input.0.<i>` for a `(x, y)` batch; with `replay=` the reference's tensors are put in its
  place. Lightning calls `training_step`, not the module, so the callback routes that one call through the
  Recorder (`Recorder.inputs`); under DDP Lightning runs `training_step` as the module's own call, which takes
  the batch first (the same names) and is not recorded itself: plumbing, not the model's forward, so the file
  holds the calls a single process's holds (under DDP the module's own `forward`, if `training_step` calls it as
  `self(x)`, goes unrecorded with it);
- the loss is the tensor Lightning's backward runs on (`manual_backward`'s under manual optimization);
- under automatic optimization Lightning runs forward and backward *inside* `optimizer.step(closure)`: the
  Recorder reads the parameter gradients when backward returns and judges the update when the closure returns
  (`record/capture/optimizer_step.py`), so gradient clipping (`gradient_clip_val`, run inside the closure) leaves
  the update not judged by the per-call probe, with that reason, as in a Trainer;
- precision: `bf16-mixed` / `16-mixed` autocast is Lightning's own (the file notes its dtype); `bf16-true` /
  `16-true` cast the module, whose dtype the file notes. `16-mixed`'s GradScaler multiplies the loss before
  backward: the Recorder is told its scale (`Recorder.loss_scale`), so the file holds the loss and the gradients
  unscaled, as a float32 reference has them (the unscaling before the step then leaves the update not judged by
  the per-call probe, with that reason);
- the optimizer(s) are `trainer.optimizers`: their state when the step begins (AdamW's moments) is in the file, and
  a replay loads it;
- under DDP (`strategy="ddp"`) rank R writes `<stem>.rank<R>.h5` and replays `<ref stem>.rank<R>.h5`, as under
  torchrun;
- gradient accumulation (`accumulate_grad_batches=K`): optimizer step N is K batches, each its own `training_step`
  and backward; the Recorder opens at the first batch of step N and closes after the batch that steps, each
  `training_step`'s batch one microbatch of the recording (docs/format.md "Microbatches").

`every=K` records the statistics of steps 0, K, 2K, ... into one multi-step file (no twin: compare holds the steps
to the tolerance). An exception inside the step reaches `on_exception`: hooks removed, no file left.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Optional

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name: the same API
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the same API under its older name
    except ImportError as _err:  # lightning is optional for oneiter, required here
        raise ImportError(f"oneiter.integrations.lightning needs PyTorch Lightning ({_err}); install it with "
                          f"`pip install lightning` (or oneiter's extra: `pip install 'oneiter[lightning]'`)") from _err

from oneiter.integrations.profile_callback import ProfileEvents
from oneiter.integrations.step_driver import DrivenCallback, meta_of
from oneiter.record.options import Amp, RecordOptions
from oneiter.record.recorder import Recorder

__all__ = ["OneIterCallback", "ProfileCallback"]

# Lightning's precision flags -> the autocast they enter (the `*-true` ones cast the module instead: no autocast)
_AUTOCAST: dict[str, Amp] = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


class OneIterCallback(DrivenCallback, pl.Callback):
    """Record optimizer step `step` (0-based `trainer.global_step`) of a Lightning run into `out` (a reference, or a
    replay of `replay`), or the statistics of every `every`-th step (0, K, 2K, ...: a multi-step file).

    Its arguments and `summary`: `step_driver.DrivenCallback`, shared with the Hugging Face callback.
    """

    def __init__(
        self,
        *,
        step: Optional[int] = None,
        every: Optional[int] = None,
        options: Optional[RecordOptions] = None,
        **record: Any,
    ):
        super().__init__(step=step, every=every, options=options, **record)
        self._routed: Optional[Any] = None  # the LightningModule whose next training_step goes through a Recorder
        self._step = -1  # the optimizer step being recorded (its batches end when `global_step` moves past it)

    # -- Lightning events -------------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        max_steps = _max_steps(trainer)
        self._driver.check_steps(max_steps)
        self._driver.start_run(pl_module, trainer.optimizers, self._options(trainer, None), max_steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        opened = self._driver.current  # the step's later batches under gradient accumulation: more microbatches
        recorder = opened or self._driver.begin(step, pl_module, trainer.optimizers,
                                                lambda: self._options(trainer, step))
        if recorder is None:
            return
        if opened is None:
            self._step = step
            scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: backward runs on the scaled loss
            if scaler is not None and scaler.is_enabled():
                recorder.loss_scale(scaler)
        self._route(pl_module, recorder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._unroute()
        if self._driver.recording and trainer.global_step != self._step:  # this batch's optimizer step ran
            self._driver.end()

    def on_train_end(self, trainer, pl_module) -> None:
        self._driver.end_run()
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.close()

    def close(self) -> None:
        """Abandon a step that did not end: hooks removed, no file left."""
        self._unroute()
        self._driver.close()

    # -- the batch ----------------------------------------------------------------------------------------------------
    def _route(self, pl_module, recorder: Recorder) -> None:
        """The module's next `training_step` call hands its batch to the Recorder (an instance attribute that
        removes itself on that call)."""
        original = pl_module.training_step
        taken = recorder.num_microbatches  # under DDP the module's own call takes the batch first

        def training_step(*args, **kwargs):
            self._unroute()
            if recorder.num_microbatches == taken:  # this batch not taken yet: it begins a microbatch
                args, kwargs = _through(recorder, args, kwargs)
            return original(*args, **kwargs)

        pl_module.training_step = training_step
        self._routed = pl_module

    def _unroute(self) -> None:
        module, self._routed = self._routed, None
        if module is not None and "training_step" in module.__dict__:
            del module.training_step

    def _options(self, trainer, step: Optional[int]) -> RecordOptions:
        """The recording's options with what the Trainer says: its autocast and precision flag. Under a wrapping
        strategy (DDP) Lightning runs `training_step` as the module's own call (its `forward` swapped for the
        call): plumbing, not the model's forward, so that call is not recorded and the file holds the calls a
        single process records."""
        precision = str(trainer.precision)
        meta = meta_of("lightning", str(pl.__version__), step, precision=precision)
        redirected = trainer.strategy.model is not None and trainer.strategy.model is not trainer.lightning_module
        skip = (*self.options.skip, "") if redirected else self.options.skip
        return replace(self.options, amp=_AUTOCAST.get(precision), meta={**self.options.meta, **meta}, skip=skip)


class ProfileCallback(ProfileEvents, pl.Callback):
    __doc__ = ProfileEvents.__doc__
    FRAMEWORK = "lightning"

    def on_train_start(self, trainer, pl_module) -> None:
        max_steps = _max_steps(trainer)
        loader = getattr(trainer, "train_dataloader", None)
        self._start(pl_module, trainer.optimizers, default_dir=trainer.default_root_dir,
                    batch_size=int(getattr(loader, "batch_size", 0) or 0), seed=_seed(),
                    amp=_AUTOCAST.get(str(trainer.precision)),
                    remaining=None if max_steps is None else max_steps - trainer.global_step,
                    first_step=trainer.global_step, version=str(pl.__version__))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._begin_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._end_step()

    def on_train_end(self, trainer, pl_module) -> None:
        self._end_run()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()


def _seed() -> int:
    """The seed `lightning.seed_everything` set (its PL_GLOBAL_SEED), else 0."""
    try:
        return int(os.environ.get("PL_GLOBAL_SEED", "0"))
    except ValueError:
        return 0


def _through(recorder: Recorder, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`training_step`'s arguments after `recorder.inputs` stored them (on replay: the reference's in their
    place), as (args, kwargs)."""
    got = recorder.inputs(*args, **kwargs)
    if kwargs:
        return got
    return ((got,) if len(args) == 1 else tuple(got)), {}


def _max_steps(trainer) -> Optional[int]:
    """The run's optimizer steps: `max_steps`, else Lightning's estimate from the epochs (None if unbounded)."""
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimate = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - Lightning raises various errors when it cannot tell (no dataloader yet)
        return None
    return int(estimate) if estimate != float("inf") else None
