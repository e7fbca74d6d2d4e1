"""`oneiter record`: a model *spec* (built-in name or `file.py:function`) recorded for one training iteration.

Pipeline: build the model from its spec (with `--replay`, with the reference's spec, batch size and seed), cast
it (`--dtype`), move it to its device, attach faults (if asked), then run `train_step` once inside an
`oneiter.Recorder` — the same class a user's own loop records with, so both write the same file.

Under torchrun (several ranks) each rank records its own `out.rank<R>.h5` through DistributedDataParallel; see
`oneiter.runtime.distributed` for what changes (seed + rank for the batch, averaged gradients, per-rank replay files).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from oneiter.errors import OneIterError, user_code
from oneiter.format.layout import IterationFile
from oneiter.record.recorder import RecordSummary, module_selector
from oneiter.record.session import check_output

__all__ = ["RecordOptions", "RecordSummary", "record", "check_output", "module_selector"]


@dataclass
class RecordOptions:
    """Everything `oneiter record` takes. `model=None` with `replay` reuses the reference's model spec."""

    out: Path
    model: str | None = None
    device: str = "cpu"
    replay: Path | None = None
    seed: int = 0
    batch_size: int | None = None  # None: 8, or the reference's with replay
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
    level: str = "full"  # "stats": statistics and checksums per tensor (format.stats)


def _build(opts: RecordOptions, ref: IterationFile | None, rank: int = 0):
    """Build the bundle; returns (bundle, build settings stored in the file). Rank R builds with seed + R (its own
    batch and labels; DDP then broadcasts rank 0's weights), a replay with the reference's own seed."""
    from oneiter.runtime.modelspec import canonical_spec, load_model, spec_for_replay

    if ref is None:
        if not opts.model:
            raise OneIterError("--model is required (or --replay a reference to reuse its model)")
        seed = opts.seed + rank
        batch_size = opts.batch_size or 8
        built = {"model": canonical_spec(opts.model), "batch_size": batch_size, "seed": seed, "model_args": opts.model_args}
        return load_model(opts.model, batch_size, seed, opts.model_args), built
    theirs = int(ref.meta["batch_size"])
    if opts.batch_size is not None and opts.batch_size != theirs:
        raise OneIterError(f"batch_size {opts.batch_size} differs from the reference's {theirs}: a replay runs the "
                           f"reference's batch; drop it", param="batch_size")
    model_args = {**json.loads(ref.meta.get("model_args") or "{}"), **opts.model_args}
    built = {
        "model": canonical_spec(spec_for_replay(ref.meta.get("model"), opts.model, ref.path.name)),
        "model_args": model_args,
        "batch_size": int(ref.meta["batch_size"]), "seed": int(ref.meta["seed"]),
    }
    return load_model(built["model"], built["batch_size"], built["seed"], model_args), built


def _meta(opts: RecordOptions, built: dict[str, Any]) -> dict[str, Any]:
    """The root attributes only a model spec knows (the Recorder writes the rest). `seed` built the model and
    batch; `rng_seed` seeded the iteration itself."""
    return {
        "model": built["model"], "model_args": json.dumps(built["model_args"], sort_keys=True),
        "batch_size": built["batch_size"], "seed": built["seed"], "rng_seed": opts.seed,
        "optimizer": opts.optimizer, "dtype": opts.dtype, "faults": json.dumps(opts.faults),
    }


def record(opts: RecordOptions, progress: Callable[[str, int], None] | None = None,
           notify: Callable[[str], None] | None = None) -> RecordSummary:
    """Record one iteration into `opts.out`; returns counts, bytes and seconds. Tests call this directly.

    `progress(phase, num_tensors)` is called after each captured tensor (phase: forward, backward, parameters).
    """
    from oneiter.runtime.distributed import process_group, rank_info, rank_path

    started = time.perf_counter()
    info = rank_info()
    opts, faults = _for_rank(opts, info)
    check_output(rank_path(opts.out, info.rank, info.world_size) if info.distributed else opts.out, opts.force)
    with _threads(opts.threads), process_group(_device(opts, info), info):
        return _record(opts, progress, notify, started, faults, info)


def _for_rank(opts: RecordOptions, info):
    """This rank's options (output and replay file, the faults aimed at it) and its parsed faults."""
    from oneiter.record.faults import parse_fault

    parsed = [parse_fault(f) for f in opts.faults]
    for fault in parsed:
        if fault.rank is not None and fault.rank >= info.world_size:
            raise OneIterError(f"--inject-fault {fault}: expected a rank below {info.world_size} (this run's "
                               f"number of ranks), got {fault.rank}")
    mine = [(text, fault) for text, fault in zip(opts.faults, parsed) if fault.applies_to(info.rank)]
    return replace(opts, faults=[text for text, _ in mine]), [fault for _, fault in mine]


def _device(opts: RecordOptions, info):
    from oneiter.runtime.devices import resolve_device
    from oneiter.runtime.distributed import local_device

    return local_device(resolve_device(opts.device), info)


@contextmanager
def _threads(num_threads: int | None):
    """--threads for the duration of one record() call (tests record several runs in one process)."""
    import torch

    from oneiter.runtime.training import set_threads

    before = torch.get_num_threads()
    set_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _record(opts: RecordOptions, progress, notify, started: float, faults, info) -> RecordSummary:
    from oneiter.record.faults import attach_faults
    from oneiter.record.recorder import Recorder
    from oneiter.runtime.distributed import replay_path, wrap_ddp
    from oneiter.runtime.precision import apply_dtype
    from oneiter.runtime.training import prepare, train_step

    device = _device(opts, info)
    replay = replay_path(opts.replay, info) if opts.replay and info.distributed else opts.replay
    with ExitStack() as stack:
        ref = stack.enter_context(IterationFile(replay)) if replay else None
        with user_code("the model builder"):
            bundle, built = _build(opts, ref, info.rank)
        stack.close()  # the Recorder opens the reference itself
        apply_dtype(bundle, opts.dtype)
        setup = prepare(bundle, device, opts.optimizer)
        if info.distributed:  # the call goes through DDP; hooks, faults and state stay on the inner bundle.model
            setup = wrap_ddp(setup)
        for handle in attach_faults(bundle.model, faults):
            stack.callback(handle.remove)
        recorder = Recorder(
            bundle.model, opts.out, optimizer=setup.optimizer, replay=opts.replay, amp=opts.amp,
            include=opts.include, exclude=opts.exclude, seed=opts.seed, isolate=opts.isolate,
            calibrate=opts.calibrate, against=opts.against, random_replay=opts.random_replay,
            fallback=opts.fallback, force=opts.force, meta=_meta(opts, built), progress=progress, notify=notify,
            queue_bytes=opts.queue_bytes, level=opts.level,
        )
        with recorder as rec:
            batch = rec.inputs(*setup.inputs)
            setup.inputs = batch if len(setup.inputs) != 1 else (batch,)
            with user_code("the training iteration (the model's forward, its loss or backward)"):
                train_step(setup)
    summary = recorder.summary
    summary.seconds = time.perf_counter() - started
    return summary
