"""`oneiter record`: run one training iteration with every module call captured into a recording.

Pipeline: build the model (or take the reference's state with `--replay`), attach faults (if asked), attach the
`ModuleCapture` hooks, run `train_step` once, write everything through the `BackgroundWriter` into a temporary
file, and rename it into place only when it is complete.

Under torchrun (several ranks) each rank records its own `out.rank<R>.h5` through DistributedDataParallel; see
`oneiter.distributed` for what changes (seed + rank for the batch, averaged gradients, per-rank replay files).
"""

from __future__ import annotations

import json
import re
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..errors import OneIterError
from ..fileformat import IterationFile
from .session import RecordingSession, atomic_output, check_output

__all__ = ["RecordOptions", "RecordSummary", "record", "check_output", "module_selector"]


@dataclass
class RecordOptions:
    """Everything `oneiter record` takes. `model=None` with `replay` reuses the reference's model spec."""

    out: Path
    model: str | None = None
    device: str = "cpu"
    replay: Path | None = None
    seed: int = 0
    batch_size: int = 8
    optimizer: str = "sgd"
    dtype: str = "float32"
    amp: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    model_args: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None
    force: bool = False
    isolate: bool = True  # with replay: teacher-forced local error of every call (--no-isolate turns it off)
    calibrate: str = "cpu"  # where expected noise is measured: cpu (float64 vs run precision) or device
    against: str | None = None  # "cpu": local error against a float32 CPU recomputation, no reference needed
    random_replay: bool = True  # with replay: random ops take the reference's values (--no-random-replay)
    fallback: list[str] = field(default_factory=list)  # regexes of ops run on the CPU in float32
    queue_bytes: int = 512 << 20


@dataclass
class RecordSummary:
    path: Path
    num_entries: int
    num_bytes: int
    file_bytes: int
    seconds: float
    loss: float
    num_calls: int


def module_selector(include: list[str], exclude: list[str]) -> Callable[[str], bool]:
    """A predicate on module paths: matches any --include regex (all if none) and no --exclude regex."""
    try:
        inc = [re.compile(p) for p in include]
        exc = [re.compile(p) for p in exclude]
    except re.error as err:
        raise OneIterError(f"bad --include/--exclude regex: {err}") from None

    def select(path: str) -> bool:
        if inc and not any(p.search(path) for p in inc):
            return False
        return not any(p.search(path) for p in exc)

    return select


def _build(opts: RecordOptions, ref: IterationFile | None, rank: int = 0):
    """Build the bundle; returns (bundle, build settings stored in the file). Rank R builds with seed + R (its own
    batch and labels; DDP then broadcasts rank 0's weights), a replay with the reference's own seed."""
    from ..modelspec import canonical_spec, load_model

    if ref is None:
        if not opts.model:
            raise OneIterError("--model is required (or --replay a reference to reuse its model)")
        seed = opts.seed + rank
        built = {"model": canonical_spec(opts.model), "batch_size": opts.batch_size, "seed": seed, "model_args": opts.model_args}
        return load_model(opts.model, opts.batch_size, seed, opts.model_args), built
    model_args = {**json.loads(ref.meta.get("model_args") or "{}"), **opts.model_args}
    built = {
        "model": canonical_spec(opts.model or ref.meta.get("model")), "model_args": model_args,
        "batch_size": int(ref.meta["batch_size"]), "seed": int(ref.meta["seed"]),
    }
    bundle = load_model(built["model"], built["batch_size"], built["seed"], model_args)
    from .reference import load_reference

    load_reference(bundle, ref)
    return bundle, built


def _meta(opts: RecordOptions, device, built: dict[str, Any]) -> dict[str, Any]:
    """The file's root attributes. `seed` built the model and batch; `rng_seed` seeded the iteration itself."""
    import torch

    from ..devices import device_name

    return {
        "model": built["model"], "model_args": json.dumps(built["model_args"], sort_keys=True),
        "batch_size": built["batch_size"], "seed": built["seed"], "rng_seed": opts.seed,
        "device": str(device), "device_type": device.type, "device_name": device_name(device),
        "dtype": opts.dtype, "amp": opts.amp, "optimizer": opts.optimizer, "num_threads": torch.get_num_threads(),
        "torch_version": str(torch.__version__), "oneiter_version": __version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "replay_of": str(opts.replay) if opts.replay else None,
        "include": json.dumps(opts.include), "exclude": json.dumps(opts.exclude),
        "faults": json.dumps(opts.faults), "fallback": json.dumps(opts.fallback),
        "random_replay": bool(opts.replay and opts.random_replay),
    }


def record(opts: RecordOptions, progress: Callable[[str, int], None] | None = None) -> RecordSummary:
    """Record one iteration into `opts.out`; returns counts, bytes and seconds. Tests call this directly.

    `progress(phase, num_tensors)` is called after each captured tensor (phase: forward, backward, parameters).
    """
    from ..distributed import process_group, rank_info

    started = time.perf_counter()
    info = rank_info()
    opts, faults = _for_rank(opts, info)
    check_output(opts.out, opts.force)
    if opts.against not in (None, "cpu"):
        raise OneIterError(f"--against takes 'cpu' (recompute each layer on the CPU in float32), got '{opts.against}'")
    if opts.calibrate not in ("cpu", "device"):
        raise OneIterError(f"--calibrate takes 'cpu' or 'device' (where each call's expected noise is measured), "
                           f"got '{opts.calibrate}'")
    if opts.against and opts.replay:
        raise OneIterError("--against cpu needs no reference: drop --replay, or drop --against to compare with it")
    if opts.fallback:
        from .fallback import compile_patterns

        compile_patterns(opts.fallback)
    select = module_selector(opts.include, opts.exclude)
    with _threads(opts.threads), process_group(_device(opts, info), info):
        return _record(opts, progress, started, faults, select, info)


def _for_rank(opts: RecordOptions, info):
    """This rank's options (output and replay file, the faults aimed at it) and its parsed faults."""
    from ..distributed import rank_path, replay_path
    from ..faults import parse_fault

    parsed = [parse_fault(f) for f in opts.faults]
    for fault in parsed:
        if fault.rank is not None and fault.rank >= info.world_size:
            raise OneIterError(f"--inject-fault {fault}: expected a rank below {info.world_size} (this run's "
                               f"number of ranks), got {fault.rank}")
    mine = [(text, fault) for text, fault in zip(opts.faults, parsed) if fault.applies_to(info.rank)]
    out, replay = opts.out, opts.replay
    if info.distributed:
        out = rank_path(out, info.rank, info.world_size)
        replay = replay_path(replay, info) if replay else None
    return replace(opts, out=out, replay=replay, faults=[text for text, _ in mine]), [fault for _, fault in mine]


def _device(opts: RecordOptions, info):
    from ..devices import resolve_device
    from ..distributed import local_device

    return local_device(resolve_device(opts.device), info)


@contextmanager
def _threads(num_threads: int | None):
    """--threads for the duration of one record() call (tests record several runs in one process)."""
    import torch

    from ..training import set_threads

    before = torch.get_num_threads()
    set_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _record(opts: RecordOptions, progress, started: float, faults, select, info) -> RecordSummary:
    from ..distributed import wrap_ddp
    from ..faults import attach_faults
    from ..precision import apply_dtype, autocast_for
    from ..training import prepare

    device = _device(opts, info)
    autocast = autocast_for(device, opts.amp)
    ref = IterationFile(opts.replay) if opts.replay else None
    try:
        _check_world_size(ref, info)
        bundle, built = _build(opts, ref, info.rank)
        apply_dtype(bundle, opts.dtype)
        setup = prepare(bundle, device, opts.optimizer)
        if info.distributed:  # the call goes through DDP; hooks, faults and state stay on the inner bundle.model
            setup = wrap_ddp(setup)
        probe_factory, local_kind = _probe_factory(opts, ref, device, autocast)
        fault_handles = attach_faults(bundle.model, faults)
        try:
            with atomic_output(opts.out, opts.force) as tmp:
                meta = {**_meta(opts, device, built), "local": local_kind, "rank": info.rank,
                        "world_size": info.world_size}
                with RecordingSession(bundle.model, tmp, meta, select=select, queue_bytes=opts.queue_bytes,
                                      progress=progress, probe_factory=probe_factory,
                                      keep_values=local_kind == "against_cpu") as session:
                    loss, modes = _run_iteration(session, setup, opts, ref, autocast)
                    num_entries, num_bytes = session.finish(loss, modes.summary())
        finally:
            for handle in fault_handles:
                handle.remove()
    finally:
        if ref is not None:
            ref.close()
    return RecordSummary(
        Path(opts.out), num_entries, num_bytes, Path(opts.out).stat().st_size, time.perf_counter() - started,
        float(loss.float()), session.module_capture.num_calls,
    )


def _check_world_size(ref: IterationFile | None, info) -> None:
    """A multi-rank reference is replayed with as many ranks (DDP averages gradients over all of them); one of its
    ranks replayed by a single process is allowed, with a warning (debugging one rank)."""
    theirs = int(ref.meta.get("world_size") or 1) if ref is not None else 1
    if theirs <= 1 or theirs == info.world_size:
        return
    if info.distributed:
        raise OneIterError(f"--replay {ref.path.name} was recorded with {theirs} ranks, this run has "
                           f"{info.world_size}: run torchrun with --nproc-per-node {theirs}")
    import warnings

    warnings.warn(f"replaying one rank of a {theirs}-rank run in a single process: forward and backward compare as "
                  f"usual, but param_grads and updated weights are not averaged and will differ", stacklevel=2)


def _probe_factory(opts: RecordOptions, ref: IterationFile | None, device, autocast):
    """Which local-error probe reruns each call: teacher forcing on replay, or --against cpu."""
    from ..precision import torch_dtype
    from .probe import make_probe_factory

    amp = autocast.fast_dtype if autocast is not None else None
    kind = "against_cpu" if opts.against == "cpu" else ("teacher_forced" if ref is not None and opts.isolate else "")
    if not kind:
        return None, ""
    return make_probe_factory(kind, ref, device, amp=amp, dtype=torch_dtype(opts.dtype),
                              calibrate=opts.calibrate), kind


class _Modes:
    """The torch modes active during forward and backward: random record/replay, op fallback."""

    def __init__(self, opts: RecordOptions, sink, ref: IterationFile | None, device):
        from .fallback import OpFallback
        from .randomness import RandomRecorder, RandomReplayer

        if ref is None:
            self.random = RandomRecorder(sink)
        else:  # without random replay: still count the random ops (each call notes which ones it ran)
            self.random = RandomReplayer(ref, device, replay=opts.random_replay)
        self.fallback = OpFallback(opts.fallback) if opts.fallback else None
        self._stack = ExitStack()

    def __enter__(self) -> "_Modes":
        for mode in (self.random, self.fallback):
            if mode is not None:
                self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the modes (before the optimizer step: its math is not part of what they judge)."""
        self._stack.close()

    def summary(self) -> dict:
        return {
            "num_random_ops": self.random.num_ops,
            "fallback_counts": json.dumps(self.fallback.counts if self.fallback is not None else {}),
        }


def _run_iteration(session: RecordingSession, setup, opts: RecordOptions, ref, autocast):
    import torch

    from ..training import train_step

    session.state_before()
    session.batch(setup.inputs)
    torch.manual_seed(opts.seed)
    modes = _Modes(opts, session.sink, ref, setup.device)
    session.attach_random(modes.random)
    session.bind_optimizer(setup.optimizer)

    def after_backward() -> None:
        modes.close()
        session.after_backward()
        session.param_grads()

    with session.capture(), modes:
        loss = train_step(
            setup, autocast=autocast, after_backward=after_backward,
            before_backward=lambda: setattr(session, "phase", "backward"),
        )
    session.state_after()
    return loss, modes
