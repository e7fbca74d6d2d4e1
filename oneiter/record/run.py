"""`oneiter record`: a model *spec* (built-in name or `file.py:function`) recorded for one training iteration, or
several (`--steps N`), or iteration S of a run (`--step S`).

Pipeline: build the model from its spec (with `--replay`, with the reference's spec, batch size and seed), cast
it (`--dtype`), move it to its device, attach faults (if asked), then run `train_step` once inside an
`oneiter.Recorder` — the same class a user's own loop records with, so both write the same file. Iteration `s`
runs the model's `batch(s)` when it has one (the model contract's fifth item). `--step S` runs iterations 0..S-1
plainly first (the RNG seeded as a recording seeds it, so iteration S is the one a `--steps` run records at S)
and records S in full, the optimizer's state included; replaying such a file starts from that state.
`--steps N` records N iterations at the statistics level through a `record.steps.step_recorder.StepRecorder`;
replaying such a file (`--replay`, `--steps` optional) runs the reference's iterations, each also by the perturbed twin.

Under torchrun (several ranks) each rank records its own `out.rank<R>.h5` through DistributedDataParallel, or, for
a model whose builder parallelises it itself (FSDP2's `fully_shard`, `torch.distributed.tensor.parallel`,
Megatron-style layers: `runtime.sharding.parallelizes_itself`), as it is, or through DDP over the dimensions of
its device mesh its parameters leave free (`--data-parallel` decides, per mesh dimension: `runtime/meshes.py`); see
`oneiter.runtime.distributed` for what changes (seed + rank for the batch, averaged gradients, per-rank replay
files).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, cast

from oneiter.errors import OneIterError, user_code
from oneiter.format.layout import IterationFile
from oneiter.record.modes.faults import attach_faults, parse_fault
from oneiter.record.modes.float8 import convert as convert_float8
from oneiter.record.options import RecordOptions
from oneiter.record.recorder import Recorder, RecordSummary, module_selector
from oneiter.record.session import check_output
from oneiter.record.steps.step_recorder import StepRecorder
from oneiter.runtime.compiled import compile_modules, find_blocks, recordable_compiles
from oneiter.runtime.devices import resolve_device
from oneiter.runtime.distributed import local_device, process_group, rank_info, rank_path, replay_path, wrap_ddp
from oneiter.runtime.host_random import seed_all
from oneiter.runtime.meshes import WORLD, check_choice, ddp_over
from oneiter.runtime.modelspec import canonical_spec, load_model, spec_for_replay
from oneiter.runtime.precision import DTYPES, apply_dtype, torch_dtype
from oneiter.runtime.training import OPTIMIZERS, prepare, set_threads, train_step, use_step

__all__ = ["SpecOptions", "RecordSummary", "record", "check_output", "module_selector"]

Dtype = Literal["float32", "bfloat16", "float16", "float64"]
OptimizerName = Literal["sgd", "adamw"]


@dataclass(kw_only=True)
class SpecOptions(RecordOptions):
    """Everything `oneiter record` takes: a recording's `RecordOptions`, and how to build the model it records.
    `model=None` with `replay` reuses the reference's model spec."""

    model: str | None = None
    """A built-in model name or `path/to/file.py:function`."""
    device: str = "cpu"
    """Where the iteration runs (`cpu`, `cuda`, `cuda:1`, `npu`, ...)."""
    batch_size: int | None = None
    """Passed to the model builder; None: 8, or the reference's with replay."""
    optimizer: OptimizerName | None = None
    """The optimizer `runtime.training` builds for the iteration (None: a replay's reference's, else sgd)."""
    dtype: Dtype = "float32"
    """The model's storage dtype."""
    faults: list[str] = field(default_factory=list)
    """`--inject-fault` specs: layers broken on purpose (`record.modes.faults`)."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model builder (with replay: over the reference's)."""
    threads: int | None = None
    """torch's intra-op threads for the call (None: torch's default)."""
    steps: int | None = None
    """Record this many consecutive iterations (0..N-1) at the statistics level into one file
    (`record/steps/step_recorder.py`); with `replay` of such a file, at most its number (None: all of them)."""
    step: int | None = None
    """Record iteration `step` alone, in full, after running 0..step-1 plainly (with `replay`: the reference's)."""
    data_parallel: str = "auto"
    """Under torchrun: `ddp` wraps the model in DistributedDataParallel, `none` runs it as built, `auto` wraps it
    unless it parallelises itself (`runtime.sharding.parallelizes_itself`), over the dimensions of its device mesh its
    parameters leave free; `DIM=ddp|none,...` decides per mesh dimension (`runtime/meshes.py`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("steps", 1), ("step", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise OneIterError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
        if self.steps is not None and self.step is not None:
            raise OneIterError("steps records several iterations, step one of them: give one of the two",
                               param="steps")
        if self.steps is not None and self.compile:
            raise OneIterError("--compile records one iteration: record one step of a compiled run with --step S",
                               param="compile")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise OneIterError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{self.optimizer}'")
        if self.dtype not in DTYPES:
            raise OneIterError(f"--dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        check_choice(self.data_parallel)


def _build(opts: SpecOptions, ref: IterationFile | None, rank: int = 0):
    """Build the bundle; returns (bundle, build settings stored in the file). Rank R builds with seed + R (its own
    batch and labels; DDP then broadcasts rank 0's weights), a replay with the reference's own seed."""
    if ref is None:
        if not opts.model:
            raise OneIterError("--model is required (or --replay a reference to reuse its model)")
        seed = (opts.seed or 0) + rank  # seed=None leaves the iteration's RNG alone; the build still needs one
        batch_size = opts.batch_size or 8
        built: dict[str, Any] = {"model": canonical_spec(opts.model), "batch_size": batch_size, "seed": seed,
                                 "model_args": opts.model_args}
        return load_model(opts.model, batch_size, seed, opts.model_args), built
    theirs = _reference_batch_size(ref)
    if theirs is None:  # a reference written by the API or a framework that did not say: the builder's own
        theirs = opts.batch_size or 8  # batch is replaced by the reference's anyway
    elif opts.batch_size is not None and opts.batch_size != theirs:
        raise OneIterError(f"batch_size {opts.batch_size} differs from the reference's {theirs}: a replay runs the "
                           f"reference's batch; drop it", param="batch_size")
    model_args = {**json.loads(ref.meta.get("model_args") or "{}"), **opts.model_args}
    built = {
        "model": canonical_spec(spec_for_replay(ref.meta.get("model"), opts.model, ref.path.name)),
        "model_args": model_args,
        "batch_size": theirs, "seed": int(ref.meta["seed"]),
    }
    return load_model(built["model"], built["batch_size"], built["seed"], model_args), built


def _reference_batch_size(ref: IterationFile) -> int | None:
    """The reference's batch size: its attribute, else the rows of its first batch tensor (None: it cannot say)."""
    stated = int(ref.meta.get("batch_size") or 0)
    if stated > 0:
        return stated
    shapes = [ref.shape_of(path) for path in ref.batch_paths()]
    return next((shape[0] for shape in shapes if shape and shape[0] > 0), None)


def _meta(opts: SpecOptions, built: dict[str, Any]) -> dict[str, Any]:
    """The root attributes only a model spec knows (the Recorder writes the rest). `seed` built the model and
    batch; `rng_seed` seeded the iteration itself."""
    return {
        "model": built["model"], "model_args": json.dumps(built["model_args"], sort_keys=True),
        "batch_size": built["batch_size"], "seed": built["seed"], "rng_seed": opts.seed,
        "dtype": opts.dtype, "faults": json.dumps(opts.faults),
        **({"iteration": built["iteration"]} if built.get("iteration") is not None else {}),
    }


def record(opts: SpecOptions, progress: Callable[[str, int], None] | None = None,
           notify: Callable[[str], None] | None = None) -> RecordSummary:
    """Record one iteration into `opts.out`; returns counts, bytes and seconds. Tests call this directly.

    `progress(phase, num_tensors)` is called after each captured tensor (phase: forward, backward, parameters).
    """
    started = time.perf_counter()
    info = rank_info()
    opts, faults = _for_rank(opts, info)
    check_output(rank_path(opts.out, info.rank, info.world_size) if info.distributed else opts.out, opts.force)
    with _threads(opts.threads), process_group(_device(opts, info), info):
        return _record(opts, progress, notify, started, faults, info)


def _for_rank(opts: SpecOptions, info):
    """This rank's options (output and replay file, the faults aimed at it) and its parsed faults."""
    parsed = [parse_fault(f) for f in opts.faults]
    for fault in parsed:
        if fault.rank is not None and fault.rank >= info.world_size:
            raise OneIterError(f"--inject-fault {fault}: expected a rank below {info.world_size} (this run's "
                               f"number of ranks), got {fault.rank}")
    mine = [(text, fault) for text, fault in zip(opts.faults, parsed, strict=True) if fault.applies_to(info.rank)]
    return replace(opts, faults=[text for text, _ in mine]), [fault for _, fault in mine]


def _device(opts: SpecOptions, info):
    return local_device(resolve_device(opts.device), info)


@contextmanager
def _threads(num_threads: int | None):
    """--threads for the duration of one record() call (tests record several runs in one process)."""
    import torch

    before = torch.get_num_threads()
    set_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _record(opts: SpecOptions, progress, notify, started: float, faults, info) -> RecordSummary:
    device = _device(opts, info)
    replay = replay_path(opts.replay, info) if opts.replay and info.distributed else opts.replay
    with ExitStack() as stack:
        ref = stack.enter_context(IterationFile(replay)) if replay else None
        with user_code("the model builder"):
            bundle, built = _build(opts, ref, info.rank)
        several = opts.steps is not None or (ref is not None and bool(ref.steps()))
        built["iteration"] = None if several else _iteration(opts, ref)
        optimizer = opts.optimizer or _reference_optimizer(ref)
        opts = replace(opts, optimizer=optimizer)
        stack.close()  # the Recorder opens the reference itself
        apply_dtype(bundle, opts.dtype)
        setup = prepare(bundle, device, optimizer)
        setup.dtype = torch_dtype(opts.dtype) if opts.dtype != "float32" else None
        # the call goes through DDP unless the model parallelises itself; hooks, faults and state stay on the inner
        # bundle.model
        over = ddp_over(opts.data_parallel, bundle.model) if info.distributed else None
        if over is not None:
            setup = wrap_ddp(setup, None if over == WORLD else over)
        if opts.float8:  # first: faults and compilation act on the converted Linears; once for every step
            stack.callback(convert_float8(bundle.model, opts.float8))
            opts = replace(opts, float8=None, meta={"float8": opts.float8, **opts.meta})
        if opts.compile:  # before the faults, whose hooks stay outside the compiled code; once for every step
            stack.callback(compile_modules(bundle.model, opts.compile, opts.compile_modules))
            opts = replace(opts, compile=None, compile_modules=[])
        elif find_blocks(bundle.model):  # compiled by its builder: random numbers replayable from the first compile
            stack.enter_context(recordable_compiles())
        for handle in attach_faults(bundle.model, faults):
            stack.callback(handle.remove)
        opts = replace(opts, meta={**_meta(opts, built), **opts.meta})
        if several:
            return _record_steps(opts, setup, progress, notify)
        step = built["iteration"]
        if step is not None and ref is None:
            _plain_steps(opts, setup, step)
        if step is not None or bundle.batch is not None:
            with user_code(f"the model's batch({step or 0})"):
                use_step(setup, step or 0)
        recorder = Recorder.from_options(bundle.model, replace(opts, seed=None) if step and ref is None else opts,
                                         optimizer=setup.optimizer, progress=progress, notify=notify)
        with recorder as rec:
            rec.run(lambda: _one_step(setup, rec))  # a function: `--impact` runs it again from its start
    summary = recorder.summary
    assert summary is not None  # the block ended without an error: the file is written
    summary.seconds = time.perf_counter() - started - summary.compile_seconds
    return summary


def _reference_optimizer(ref: IterationFile | None) -> OptimizerName:
    """A replay's optimizer when none is named: the reference's, if `oneiter record` built it; else sgd."""
    theirs = str(ref.meta.get("optimizer") or "") if ref is not None else ""
    return cast(OptimizerName, theirs) if theirs in OPTIMIZERS else "sgd"  # cast: `in OPTIMIZERS` checked it


def _iteration(opts: SpecOptions, ref: IterationFile | None) -> int | None:
    """Which iteration a one-iteration recording is: `--step`, or a replay's reference's (its `iteration`)."""
    if ref is None:
        return opts.step
    theirs = ref.meta.get("iteration")
    if opts.step is not None and opts.step != theirs:
        raise OneIterError(f"step {opts.step} is not the iteration the reference '{ref.path.name}' recorded "
                           f"({theirs if theirs is not None else 'not said'}): a replay runs the reference's; drop "
                           f"--step", param="step")
    return theirs if isinstance(theirs, int) else None


def _plain_steps(opts: SpecOptions, setup, step: int) -> None:
    """Iterations 0..step-1, not recorded, with the RNG seeded as a recording's first iteration seeds it."""
    if opts.seed is not None:
        seed_all(opts.seed)
    for s in range(step):
        with user_code(f"the model's batch({s})"):
            use_step(setup, s)
        with user_code(f"iteration {s} (the model's forward, its loss or backward)"):
            train_step(setup)


def _one_step(setup, rec) -> None:
    """One iteration inside a Recorder (or a StepRecorder's step): its batch through `rec.inputs`, then the step."""
    batch = rec.inputs(*setup.inputs)
    setup.inputs = batch if len(setup.inputs) != 1 else (batch,)
    with user_code("the training iteration (the model's forward, its loss or backward)", rec.locate):
        train_step(setup)


def _record_steps(opts: SpecOptions, setup, progress, notify) -> RecordSummary:
    """`--steps N` (or a replay of a multi-step reference): every iteration through a StepRecorder, each run by
    the twin too when replaying."""
    recorder = StepRecorder.from_options(setup.bundle.model, opts, opts.steps, optimizer=setup.optimizer,
                                         progress=progress, notify=notify)

    def one_step(step: int) -> None:
        with user_code(f"the model's batch({step})"):
            use_step(setup, step)
        _one_step(setup, recorder)

    with recorder:
        recorder.run(one_step)
    assert recorder.summary is not None  # the block ended without an error: the file is written
    return recorder.summary
