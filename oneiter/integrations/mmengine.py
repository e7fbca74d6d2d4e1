"""mmengine hooks: record one training iteration of a Runner like `oneiter record` does, or profile it.

Importing this module registers `OneIterRecordHook` and `OneIterProfilerHook` in mmengine's `HOOKS` registry::

    custom_imports = dict(imports=['oneiter.integrations.mmengine'], allow_failed_imports=False)
    custom_hooks = [dict(type='OneIterRecordHook', iteration=10, out='work_dirs/iter10.h5')]

Where it sits: the hooks are adapters. Recording is an `oneiter.Recorder` around one `train_step` call (the
same class `oneiter record` and a user's own loop record with; its settings one `RecordOptions`, on the pattern of
`integrations/recording.py`), profiling a `profile.profile_session.ProfileSession`, so
a file written here reads, compares and replays like one written by `oneiter record`.

How the record hook drives one iteration: mmengine has no hook around `train_step` and none on an exception, so
`before_train_iter` of iteration N shadows `runner.model.train_step` with a wrapper for exactly one call, which
runs the real `train_step` inside the Recorder. What the Recorder takes from mmengine:

- the batch is what the data preprocessor delivered: the Recorder stores the arguments of the model's first
  forward call (and, with `replay=`, replaces them by the reference's batch first); the preprocessor itself is
  never captured;
- gradient accumulation (`OptimWrapper(accumulative_counts=K)`): the optimizer steps once every K iterations, so
  the hook records the whole window of iterations that step closes, each `train_step` one microbatch of the
  recording (docs/format.md "Microbatches"): `iteration=N` records the window holding iteration N (iterations
  N - N % K to the one that steps), and `every` must be a multiple of K;
- parameter gradients are read by a step pre-hook on every optimizer of the `OptimWrapper(Dict)`, right before
  the step;
- autocast is mmengine's own (`AmpOptimWrapper`); the Recorder only notes its dtype;
- the loss is `outputs['loss']`, the sum `parse_losses` built and backward ran on (each microbatch's); every
  entry of the loss dict is in the root attribute `loss_dict` (JSON; a list of one dict per microbatch under
  accumulation).

`every=K` instead of `iteration=N` records the statistics of every K-th iteration (0, K, 2K, ...) into one
multi-step file (`record/steps/step_recorder.py`; no twin: the runner's iteration cannot be run twice, so `oneiter
compare` holds these steps to the tolerance, docs/steps.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

try:
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS
except ImportError as _err:  # mmengine is optional for oneiter, required here
    raise ImportError(
        f"oneiter.integrations.mmengine needs mmengine ({_err}); install it with `pip install mmengine`"
    ) from _err

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.integrations.recording import for_step, open_steps, settings
from oneiter.record.options import RecordOptions
from oneiter.record.recorder import Recorder
from oneiter.record.session import check_output
from oneiter.record.start.reference import check_structure
from oneiter.record.steps.step_recorder import StepRecorder
from oneiter.runtime.devices import device_type
from oneiter.runtime.distributed import current_rank, rank_path

__all__ = ["OneIterRecordHook", "OneIterProfilerHook"]

PathLike = Union[str, os.PathLike]
_PREPROCESSOR = "data_preprocessor"
_ABSENT = object()


def _unwrap(model):
    """The model inside a DDP/FSDP wrapper (its names are the state_dict names), or the model itself."""
    from mmengine.model import is_model_wrapper

    return model.module if is_model_wrapper(model) else model


def _rank_path(out: Path) -> Path:
    """`run.h5` on a single process; `run.rank<R>.h5` when several ranks would otherwise write the same file."""
    info = current_rank()
    return rank_path(out, info.rank, info.world_size)


def _optimizers(optim_wrapper) -> list:
    """The torch optimizers behind an OptimWrapper or an OptimWrapperDict (one per sub-model)."""
    from mmengine.optim import OptimWrapperDict

    if isinstance(optim_wrapper, OptimWrapperDict):
        return [w.optimizer for w in optim_wrapper.values()]
    return [optim_wrapper.optimizer]


def _amp_dtype(optim_wrapper, type_name: str):
    """The autocast dtype of an AmpOptimWrapper (None when the run is not mixed precision); without its own
    dtype, the device table's default (bfloat16 on the CPU, float16 on accelerators: torch's autocast defaults)."""
    import torch
    from mmengine.optim import AmpOptimWrapper

    if not isinstance(optim_wrapper, AmpOptimWrapper):
        return None
    dtype = getattr(optim_wrapper, "cast_dtype", None)
    return dtype or getattr(torch, device_type(type_name).autocast_dtype)


@HOOKS.register_module()
class OneIterRecordHook(Hook):
    """Record training iteration `iteration` (0-based, `runner.iter`) into the HDF5 file `out`.

    Args:
        iteration: the iteration to record; `runner.iter` when it starts.
        every: instead of `iteration`, record the statistics of every `every`-th iteration (0, K, 2K, ...) into one
            multi-step file (a replay: the reference's iterations).
        options: the recording's settings, a `oneiter.record.options.RecordOptions`; or, as keywords (what an
            mmengine config gives), those `oneiter.Recorder` takes (`integrations/recording.py`), among them:
        out: the `.h5` file to write (relative to the current directory). In a run with several ranks, rank R
            writes `<stem>.rank<R>.h5`.
        replay: a recording (from this hook or `oneiter record`) whose weights, buffers, batch and optimizer state
            this run starts iteration N from, bit for bit.
        include / exclude: regexes on module paths (`named_modules()` names), as `--include`/`--exclude`.
            The data preprocessor is never captured: `batch/` holds what it delivered.
        seed: `torch.manual_seed(seed)` right before the iteration, so dropout draws the same numbers in the
            reference and the replay (None: leave the RNG alone).
        model_name: the `model` attribute of the file (default: the model's class name). Compare refuses two
            files with different model names.
        isolate: with `replay`, also store each module call's local error, teacher-forced on the reference's
            inputs (as `oneiter record --replay`); False skips that rerun.
        force: overwrite `out` if it exists.
        Not `amp`: the runner's `AmpOptimWrapper` decides it.
    """

    priority = "NORMAL"

    def __init__(
        self,
        *,
        iteration: Optional[int] = None,
        every: Optional[int] = None,
        options: Optional[RecordOptions] = None,
        **record: Any,
    ):
        if (iteration is None) == (every is None):
            raise ValueError(f"one of iteration and every should be given, but got "
                             f"{'both' if iteration is not None else 'neither'}")
        if iteration is not None and (not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0):
            raise ValueError(f"iteration should be a non-negative int, but got {iteration!r}")
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"every should be an int >= 1, but got {every!r}")
        _check_types(record)
        self.iteration, self.every = iteration, every
        self._steps: Optional[StepRecorder] = None  # `every`: the multi-step recording of the run
        try:  # mmengine's convention: ValueError/TypeError in its own wording
            # autocast is mmengine's own (AmpOptimWrapper); the data preprocessor's output is the batch
            self.options = settings(type(self).__name__, options, record, skip=(_PREPROCESSOR,))
        except OneIterError as err:
            if err.param in ("include", "exclude"):
                raise ValueError(f"include/exclude should be valid regular expressions, but {err}") from None
            raise ValueError(str(err)) from None
        self.out, self.replay = self.options.out, self.options.replay
        if self.replay is not None and not self.replay.is_file():
            raise FileNotFoundError(f"replay should be an existing recording (.h5), but got '{self.replay}'")
        self._check_out(_rank_path(self.out))
        self._wrapped = None  # the model whose train_step is shadowed, until the window's last call starts
        self._previous: Any = _ABSENT  # the instance attribute train_step had before (a compiled one), if any
        self._window: Optional[tuple[int, int]] = None  # the iterations recorded as one (first, last): accumulation
        self._open: Optional[Any] = None  # the recording's block while its window runs (a Recorder, or a step's)
        self._called = False  # the wrapped train_step ran in this iteration
        self._losses: list[dict[str, float]] = []  # each microbatch's loss dict
        self.summary: Optional[dict[str, Any]] = None  # file, tensors, bytes, seconds, loss once recorded

    def _check_out(self, out: Path) -> None:
        check_output(out, self.options.force)

    # -- runner callbacks -------------------------------------------------------------------------------------------
    def before_train(self, runner) -> None:
        self._check_out(_rank_path(self.out))
        max_iters = getattr(runner, "max_iters", None)
        counts = _accumulative_counts(runner.optim_wrapper)
        if self.every is not None and self.every % counts:
            raise ValueError(f"every should be a multiple of the optimizer wrapper's accumulative_counts ({counts}: "
                             f"each recorded step is a window of {counts} iterations), but got {self.every}")
        if self.iteration is not None and isinstance(max_iters, int) and self.iteration >= max_iters:
            raise ValueError(
                f"iteration should be less than the number of training iterations ({max_iters}), "
                f"but got {self.iteration}: nothing would be recorded"
            )
        if self.every is not None:
            self._open_steps(runner, max_iters)
        elif self.replay is not None:  # fail now rather than after N iterations
            with IterationFile(self.replay) as ref:
                check_structure(_unwrap(runner.model), ref)

    def _open_steps(self, runner, max_iters) -> None:
        """`every`: the multi-step recording of iterations 0, K, 2K, ... (a replay: the reference's)."""
        model = _unwrap(runner.model)
        options = for_step(self.options, amp=self._amp(runner, model), meta=self._meta(runner))
        assert self.every is not None  # called for `every` alone
        self._steps = open_steps(model, options, every=self.every, max_steps=max_iters,
                                 optimizer=_optimizers(runner.optim_wrapper))

    def _amp(self, runner, model) -> Optional[str]:
        param = next(model.parameters(), None)
        amp = _amp_dtype(runner.optim_wrapper, param.device.type if param is not None else "cpu")
        return str(amp) if amp is not None else None

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        self._called = False
        wanted = self._steps.next_step if self._steps is not None else self.iteration
        if self._wrapped is not None or wanted is None or (self._steps is None and self.summary is not None):
            return  # a window under way keeps its wrapper
        counts = _accumulative_counts(runner.optim_wrapper)
        first = wanted - wanted % counts  # the first iteration of the window holding `wanted`
        if runner.iter != first:
            return
        max_iters = getattr(runner, "max_iters", None)
        last = first + counts - 1 if not isinstance(max_iters, int) else min(first + counts, max_iters) - 1
        self._window, self._losses = (first, last), []
        if counts > 1 and self._steps is None:
            runner.logger.info(f"oneiter: iteration {wanted} accumulates gradients with iterations {first}..{last} "
                               f"(accumulative_counts {counts}): recording them as one iteration of {last - first + 1}"
                               f" microbatches")
        model = runner.model
        original = model.train_step

        def train_step(*args, **kwargs):
            return self._record(runner, original, args, kwargs)

        # an instance attribute shadows the class's method (nn.Module.__setattr__ stores a function as is); one may
        # already be there: mmengine's `compile=True` stores the compiled train_step that way
        self._previous = model.__dict__.get("train_step", _ABSENT)
        model.train_step = train_step
        self._wrapped = model

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self._wrapped is not None and not self._called:
            self._abandon()
            raise RuntimeError(
                f"OneIterRecordHook: iteration {runner.iter} did not call runner.model.train_step; "
                "this training loop is not supported"
            )

    def after_train(self, runner) -> None:
        self._abandon()
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.__exit__(None, None, None)
            summary = steps.summary
            assert summary is not None  # a clean exit wrote the file and its summary
            self.summary = {"file": str(summary.path), "num_steps": summary.num_steps,
                            "num_entries": summary.num_entries, "seconds": summary.seconds, "loss": summary.loss}
            runner.logger.info(f"oneiter: recorded {summary.num_steps} iterations (every {self.every}) into "
                               f"{summary.path}")
            return
        if self.summary is None:
            runner.logger.warning(
                f"OneIterRecordHook: training ended at iteration {runner.iter} without reaching iteration "
                f"{self.iteration}: nothing was recorded into {self.out}"
            )

    def after_run(self, runner) -> None:
        self._abandon()
        steps, self._steps = self._steps, None
        if steps is not None:  # training stopped before after_train: no file
            steps.__exit__(RuntimeError, RuntimeError("the run did not end"), None)

    def _restore(self) -> None:
        if self._wrapped is not None:
            if self._previous is _ABSENT:
                self._wrapped.__dict__.pop("train_step", None)
            else:
                self._wrapped.__dict__["train_step"] = self._previous
            self._wrapped, self._previous = None, _ABSENT

    # -- the recorded iteration -------------------------------------------------------------------------------------
    def _record(self, runner, train_step, args: tuple, kwargs: dict):
        """One `train_step` of the window being recorded (one iteration, or the iterations one accumulated step
        spans): the recording's block opens at its first call and closes after its last."""
        self._called = True
        assert self._window is not None  # the wrapper is in place only while a window runs
        first, last = self._window
        if self._open is None:
            self._open = self._block(runner, first)
            self._rec = self._open.__enter__()
        try:
            outputs = train_step(*args, **kwargs)
            loss, loss_dict = _loss_of(outputs)
            self._rec.loss(loss)  # this microbatch's
            self._losses.append(loss_dict)
            self._rec.note(loss_dict=json.dumps(self._losses[0] if len(self._losses) == 1 else self._losses))
        except BaseException:
            self._abandon(sys.exc_info())
            raise
        if runner.iter >= last:
            self._restore()
            block, self._open, self._rec = self._open, None, None
            block.__exit__(None, None, None)
            if isinstance(block, Recorder):
                self._recorded(runner, block.summary)
        return outputs

    def _block(self, runner, first: int):
        """The recording's block for the window starting at iteration `first`: one more step of the multi-step
        recording (`every`), or a Recorder of its own."""
        if self._steps is not None:
            return self._steps.step(first)
        model = _unwrap(runner.model)
        options = for_step(self.options, amp=self._amp(runner, model), meta=self._meta(runner))
        return Recorder.from_options(model, options, optimizer=_optimizers(runner.optim_wrapper))

    def _abandon(self, exc_info=None) -> None:
        """The window did not end (an exception inside it, or training stopped): the wrapper goes, and the block is
        left with the exception (no file)."""
        self._restore()
        block, self._open, self._rec = self._open, None, None
        if block is not None:
            block.__exit__(*(exc_info or (RuntimeError, RuntimeError("the recorded iteration did not end"), None)))

    def _recorded(self, runner, summary) -> None:
        self.summary = {
            "file": str(summary.path), "num_entries": summary.num_entries, "num_bytes": summary.num_bytes,
            "seconds": summary.seconds, "loss": summary.loss,
        }
        runner.logger.info(
            f"oneiter: recorded iteration {self.iteration} into {summary.path}: {summary.num_entries} tensors, "
            f"{summary.num_bytes / 2**20:.1f} MB, {summary.seconds:.2f} s, loss {summary.loss:.6g}"
            + (f" (replay of {self.replay})" if self.replay else "")
        )

    def _meta(self, runner) -> dict[str, Any]:
        """What only the runner knows, on top of the root attributes the Recorder writes."""
        loader = getattr(runner, "train_dataloader", None)
        return {
            "batch_size": int(getattr(loader, "batch_size", 0) or 0), "seed": int(runner.seed),
            **({"iteration": self.iteration} if self.iteration is not None else {}),
            "framework": "mmengine", "mmengine_version": _mmengine_version(),
        }


def _accumulative_counts(optim_wrapper) -> int:
    """How many iterations the optimizer wrapper(s) accumulate gradients over before a step (1: every iteration
    steps); the largest of an `OptimWrapperDict`'s."""
    from mmengine.optim import OptimWrapperDict

    wrappers = list(optim_wrapper.values()) if isinstance(optim_wrapper, OptimWrapperDict) else [optim_wrapper]
    return max([int(getattr(w, "_accumulative_counts", 1) or 1) for w in wrappers] or [1])


def _check_types(record: dict[str, Any]) -> None:
    """The recording keywords a config gives, checked in mmengine's words ("should be X, but got Y")."""
    out, seed, name = record.get("out"), record.get("seed"), record.get("model_name")
    if "out" in record and not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out should be a file path (str or PathLike), but got {out!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed should be an int or None, but got {seed!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"model_name should be a str or None, but got {name!r}")


def _mmengine_version() -> str:
    import mmengine

    return str(mmengine.__version__)


def _loss_of(outputs) -> tuple[Any, dict[str, float]]:
    """The loss backward ran on (`outputs['loss']`) and every scalar of the loss dict as floats."""
    import torch

    loss = outputs.get("loss") if isinstance(outputs, dict) else None
    if not isinstance(loss, torch.Tensor):
        raise OneIterError(
            f"train_step should return a dict with a 'loss' tensor (BaseModel.parse_losses), but got {type(outputs)}"
        )
    loss_dict = {
        str(k): float(v.detach().float().mean()) for k, v in outputs.items() if isinstance(v, torch.Tensor)
    }
    return loss, loss_dict



from oneiter.integrations._mmengine_profiler import OneIterProfilerHook  # noqa: E402,F401  (registers itself in HOOKS)
