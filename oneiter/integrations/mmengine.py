"""mmengine hooks: record one training iteration of a Runner like `oneiter record` does, or profile it.

Importing this module registers `OneIterRecordHook` and `OneIterProfilerHook` in mmengine's `HOOKS` registry::

    custom_imports = dict(imports=['oneiter.integrations.mmengine'], allow_failed_imports=False)
    custom_hooks = [dict(type='OneIterRecordHook', iteration=10, out='work_dirs/iter10.h5')]

Where it sits: the hooks are adapters. Recording goes through `recorders.session.RecordingSession` (the one owner
of the file format and its invariants) and replay through `recorders.reference.check_structure`, so a file
written here reads, compares and replays like one written by `oneiter record`.

How the record hook drives one iteration: mmengine has no hook around `train_step` and none on an exception, so
`before_train_iter` of iteration N shadows `runner.model.train_step` with a wrapper for exactly one call. The
wrapper opens the session, (with `replay=`) loads the reference's weights, writes `state_before`, seeds torch,
runs the real `train_step` with the module hooks attached, and writes `state_after` and the loss. Everything is in
`with` blocks: on an exception every hook handle is removed and no file is left behind. Inside `train_step`:

- the batch is what the data preprocessor delivered: a forward pre-hook on the model stores it (and, with
  `replay=`, replaces it by the reference's batch first);
- parameter gradients are read by a step pre-hook on the optimizer, right before the step (or after
  `train_step` if this iteration does not step, under gradient accumulation);
- the loss is `outputs['loss']`, the sum `parse_losses` built and backward ran on; every entry of the loss
  dict is in the root attribute `loss_dict` (JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

try:
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS
except ImportError as _err:  # mmengine is optional for oneiter, required here
    raise ImportError(
        f"oneiter.integrations.mmengine needs mmengine ({_err}); install it with `pip install mmengine`"
    ) from _err

from .. import __version__
from ..errors import OneIterError
from ..fileformat import IterationFile
from ..recorders.record import module_selector
from ..recorders.reference import check_structure
from ..recorders.session import RecordingSession, atomic_output
from ._batch import BatchSwap, map_call, read_batch, store_batch

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
    from mmengine.dist import get_dist_info

    rank, world_size = get_dist_info()
    return out if world_size <= 1 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def _patterns(value, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"{name} should be None, a regex string or a list of them, but got {value!r}")


def _optimizers(optim_wrapper) -> list:
    """The torch optimizers behind an OptimWrapper or an OptimWrapperDict (one per sub-model)."""
    from mmengine.optim import OptimWrapperDict

    if isinstance(optim_wrapper, OptimWrapperDict):
        return [w.optimizer for w in optim_wrapper.values()]
    return [optim_wrapper.optimizer]


def _amp_dtype(optim_wrapper, device):
    """The autocast dtype of an AmpOptimWrapper (None when the run is not mixed precision)."""
    import torch
    from mmengine.optim import AmpOptimWrapper

    if not isinstance(optim_wrapper, AmpOptimWrapper):
        return None
    dtype = getattr(optim_wrapper, "cast_dtype", None)
    return dtype or (torch.bfloat16 if device.type == "cpu" else torch.float16)


@HOOKS.register_module()
class OneIterRecordHook(Hook):
    """Record training iteration `iteration` (0-based, `runner.iter`) into the HDF5 file `out`.

    Args:
        iteration: the iteration to record; `runner.iter` when it starts.
        out: the `.h5` file to write (relative to the current directory). In a run with several ranks, rank R
            writes `<stem>.rank<R>.h5`.
        replay: a recording (from this hook or `oneiter record`) whose weights, buffers and batch this run starts
            iteration N from, bit for bit. The optimizer's state (momentum, Adam moments) is not in a recording:
            replay at iteration 0 or with a stateless optimizer to compare the updated weights too.
        include / exclude: regexes on module paths (`named_modules()` names), as `--include`/`--exclude`.
            The data preprocessor is never captured: `batch/` holds what it delivered.
        seed: `torch.manual_seed(seed)` right before the iteration, so dropout draws the same numbers in the
            reference and the replay (None: leave the RNG alone).
        model_name: the `model` attribute of the file (default: the model's class name). Compare refuses two
            files with different model names.
        isolate: with `replay`, also store each leaf layer's local error, teacher-forced on the reference's
            inputs (as `oneiter record --replay`); False skips that rerun.
        force: overwrite `out` if it exists.
    """

    priority = "NORMAL"

    def __init__(
        self,
        *,
        iteration: int,
        out: PathLike,
        replay: Optional[PathLike] = None,
        include: Union[str, Sequence[str], None] = None,
        exclude: Union[str, Sequence[str], None] = None,
        seed: Optional[int] = 0,
        model_name: Optional[str] = None,
        isolate: bool = True,
        force: bool = False,
    ):
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise ValueError(f"iteration should be a non-negative int, but got {iteration!r}")
        if not isinstance(out, (str, os.PathLike)):
            raise TypeError(f"out should be a file path (str or PathLike), but got {out!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed should be an int or None, but got {seed!r}")
        if model_name is not None and not isinstance(model_name, str):
            raise TypeError(f"model_name should be a str or None, but got {model_name!r}")
        self.iteration = iteration
        self.out = Path(out)
        self.force = bool(force)
        self.include = _patterns(include, "include")
        self.exclude = _patterns(exclude, "exclude")
        try:
            self._user_select = module_selector(self.include, self.exclude)
        except OneIterError as err:
            raise ValueError(f"include/exclude should be valid regular expressions, but {err}") from None
        self.replay = None if replay is None else Path(replay)
        if self.replay is not None and not self.replay.is_file():
            raise FileNotFoundError(f"replay should be an existing recording (.h5), but got '{self.replay}'")
        self.seed = seed
        self.model_name = model_name
        self.isolate = bool(isolate)
        self._check_out(_rank_path(self.out))
        self._wrapped = None  # the model whose train_step is shadowed, until that call starts
        self._previous: Any = _ABSENT  # the instance attribute train_step had before (a compiled one), if any
        self.summary: Optional[dict[str, Any]] = None  # file, tensors, bytes, seconds, loss once recorded

    def _check_out(self, out: Path) -> None:
        if out.is_dir():
            raise ValueError(f"out should be a file name such as '{out / 'iter.h5'}', but got the directory '{out}'")
        if out.exists() and not self.force:
            raise FileExistsError(f"out '{out}' already exists; pass force=True to overwrite it")
        if not out.parent.exists():
            raise FileNotFoundError(f"the directory of out '{out}' does not exist")

    # -- runner callbacks -------------------------------------------------------------------------------------------
    def before_train(self, runner) -> None:
        self._check_out(_rank_path(self.out))
        max_iters = getattr(runner, "max_iters", None)
        if isinstance(max_iters, int) and self.iteration >= max_iters:
            raise ValueError(
                f"iteration should be less than the number of training iterations ({max_iters}), "
                f"but got {self.iteration}: nothing would be recorded"
            )
        if self.replay is not None:  # fail now rather than after N iterations
            with IterationFile(self.replay) as ref:
                check_structure(_unwrap(runner.model), ref)

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if runner.iter != self.iteration or self.summary is not None:
            return
        model = runner.model
        original = model.train_step

        def train_step(*args, **kwargs):
            self._restore()  # one call only
            return self._record(runner, original, args, kwargs)

        # an instance attribute shadows the class's method (nn.Module.__setattr__ stores a function as is); one may
        # already be there: mmengine's `compile=True` stores the compiled train_step that way
        self._previous = model.__dict__.get("train_step", _ABSENT)
        model.train_step = train_step
        self._wrapped = model

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self._wrapped is not None:
            self._restore()
            raise RuntimeError(
                f"OneIterRecordHook: iteration {self.iteration} did not call runner.model.train_step; "
                "this training loop is not supported"
            )

    def after_train(self, runner) -> None:
        self._restore()
        if self.summary is None:
            runner.logger.warning(
                f"OneIterRecordHook: training ended at iteration {runner.iter} without reaching iteration "
                f"{self.iteration}: nothing was recorded into {self.out}"
            )

    def after_run(self, runner) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._wrapped is not None:
            if self._previous is _ABSENT:
                self._wrapped.__dict__.pop("train_step", None)
            else:
                self._wrapped.__dict__["train_step"] = self._previous
            self._wrapped, self._previous = None, _ABSENT

    # -- the recorded iteration -------------------------------------------------------------------------------------
    def _record(self, runner, train_step, args: tuple, kwargs: dict):
        import torch

        started = time.perf_counter()
        model = _unwrap(runner.model)
        out = _rank_path(self.out)
        device = _device_of(model)
        with contextlib.ExitStack() as stack:
            ref = stack.enter_context(IterationFile(self.replay)) if self.replay is not None else None
            swap = self._load_reference(runner, model, ref) if ref is not None else None
            tmp = stack.enter_context(atomic_output(out, self.force))
            param = next(model.parameters(), None)
            probe_factory, local_kind = self._probe_factory(ref, device, _amp_dtype(runner.optim_wrapper, device),
                                                            param.dtype if param is not None else None)
            meta = {**self._meta(runner, model, device), "local": local_kind}
            session = stack.enter_context(
                RecordingSession(model, tmp, meta, select=self._select, probe_factory=probe_factory)
            )
            optimizers = _optimizers(runner.optim_wrapper)
            if len(optimizers) == 1:
                session.bind_optimizer(optimizers[0])
            session.state_before()
            if self.seed is not None:
                torch.manual_seed(self.seed)
            with session.capture(), _batch_hook(model, session, swap), _grad_hook(runner, session) as grads:
                outputs = train_step(*args, **kwargs)
            if not grads["done"]:  # no optimizer step this iteration (gradient accumulation): grads still there
                session.after_backward()
                session.param_grads()
            session.state_after()
            loss, loss_dict = _loss_of(outputs)
            num_entries, num_bytes = session.finish(loss, {"loss_dict": json.dumps(loss_dict)})
        self.summary = {
            "file": str(out), "num_entries": num_entries, "num_bytes": num_bytes,
            "seconds": time.perf_counter() - started, "loss": float(loss.detach().float()),
        }
        runner.logger.info(
            f"oneiter: recorded iteration {self.iteration} into {out}: {num_entries} tensors, "
            f"{num_bytes / 2**20:.1f} MB, {self.summary['seconds']:.2f} s, loss {self.summary['loss']:.6g}"
            + (f" (replay of {self.replay})" if self.replay else "")
        )
        return outputs

    def _select(self, path: str) -> bool:
        if path == _PREPROCESSOR or path.startswith(_PREPROCESSOR + "."):
            return False
        return self._user_select(path)

    def _load_reference(self, runner, model, ref: IterationFile) -> BatchSwap:
        """Load the reference's weights and buffers into `model`; return the swap that hands out its batch."""
        import torch

        check_structure(model, ref)
        state = {name: ref.tensor(path) for name, path in ref.state().items()}
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
        if any(opt.state for opt in _optimizers(runner.optim_wrapper)):
            runner.logger.warning(
                "OneIterRecordHook: the optimizer has state (momentum, moments) that a recording does not hold: "
                "state_after may differ from the reference's even when every gradient matches"
            )
        return BatchSwap(read_batch(ref), ref.path.name)

    def _probe_factory(self, ref: Optional[IterationFile], device, amp_dtype, dtype=None):
        if ref is None or not self.isolate:
            return None, ""
        from ..recorders.probe import make_probe_factory

        return make_probe_factory("teacher_forced", ref, device, amp=amp_dtype, dtype=dtype), "teacher_forced"

    def _meta(self, runner, model, device) -> dict[str, Any]:
        """The root attributes `oneiter record` writes, filled from the runner, plus `iteration`."""
        import torch

        from ..devices import device_name

        param = next(model.parameters(), None)
        optimizers = _optimizers(runner.optim_wrapper)
        amp = _amp_dtype(runner.optim_wrapper, device)
        loader = getattr(runner, "train_dataloader", None)
        return {
            "model": self.model_name or type(model).__name__, "model_args": "{}",
            "batch_size": int(getattr(loader, "batch_size", 0) or 0), "seed": int(runner.seed),
            "rng_seed": self.seed, "device": str(device), "device_type": device.type,
            "device_name": device_name(device),
            "dtype": str(param.dtype).removeprefix("torch.") if param is not None else "float32",
            "amp": str(amp).removeprefix("torch.") if amp is not None else None,
            "optimizer": ",".join(type(o).__name__.lower() for o in optimizers),
            "num_threads": torch.get_num_threads(), "torch_version": str(torch.__version__),
            "oneiter_version": __version__, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "replay_of": str(self.replay) if self.replay else None,
            "include": json.dumps(self.include), "exclude": json.dumps(self.exclude), "faults": "[]",
            "iteration": self.iteration, "framework": "mmengine", "mmengine_version": _mmengine_version(),
        }


def _mmengine_version() -> str:
    import mmengine

    return str(mmengine.__version__)


def _device_of(model):
    import torch

    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


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


@contextlib.contextmanager
def _batch_hook(model, session: RecordingSession, swap: Optional[BatchSwap]):
    """Store the batch of the model's first forward call (after swapping in the reference's, with replay).

    Prepended, so it runs before the capture's own pre-hook on the model: that one sees the swapped batch.
    """
    seen = []

    def pre_hook(module, args, kwargs):
        if seen:
            return None
        seen.append(True)
        if swap is not None:
            args, kwargs = map_call(args, kwargs, swap)
            swap.check_complete()
        store_batch(session.sink, args, kwargs)
        return (args, kwargs) if swap is not None else None

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()
    if swap is not None and not seen:
        raise OneIterError("replay: the model's forward was never called, so the reference's batch was not used")


@contextlib.contextmanager
def _grad_hook(runner, session: RecordingSession):
    """Parameter gradients, read once right before the first optimizer step of the iteration."""
    state = {"done": False}

    def hook(optimizer, args, kwargs):
        if not state["done"]:
            state["done"] = True
            session.after_backward()
            session.param_grads()
        return None

    handles = [opt.register_step_pre_hook(hook) for opt in _optimizers(runner.optim_wrapper)]
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()


from ._mmengine_profiler import OneIterProfilerHook  # noqa: E402,F401  (registers itself in HOOKS)
