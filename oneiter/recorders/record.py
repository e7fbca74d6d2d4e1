"""`oneiter record`: run one training iteration with every module call captured into a recording.

Pipeline: build the model (or take the reference's state with `--replay`), attach faults (if asked), attach the
`ModuleCapture` hooks, run `train_step` once, write everything through the `BackgroundWriter` into a temporary
file, and rename it into place only when it is complete.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..errors import OneIterError
from ..fileformat import BATCH, LOSS, PARAM_GRADS, STATE_AFTER, STATE_BEFORE, IterationFile

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


def check_output(out: Path, force: bool) -> Path:
    """Refuse to overwrite an existing file without --force, and fail early on a missing directory."""
    out = Path(out)
    if out.is_dir():
        raise OneIterError(f"output '{out}' is a directory; give a file name such as {out / 'run.h5'}")
    if out.exists() and not force:
        raise OneIterError(f"output '{out}' already exists; pass --force to overwrite it")
    if not out.parent.exists():
        raise OneIterError(f"output directory '{out.parent}' does not exist")
    return out


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


def _build(opts: RecordOptions, ref: IterationFile | None):
    """Build the bundle; returns (bundle, build settings stored in the file)."""
    from ..modelspec import load_model

    if ref is None:
        if not opts.model:
            raise OneIterError("--model is required (or --replay a reference to reuse its model)")
        built = {"model": opts.model, "batch_size": opts.batch_size, "seed": opts.seed, "model_args": opts.model_args}
        return load_model(opts.model, opts.batch_size, opts.seed, opts.model_args), built
    model_args = {**json.loads(ref.meta.get("model_args") or "{}"), **opts.model_args}
    built = {
        "model": opts.model or ref.meta.get("model"), "model_args": model_args,
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
        "faults": json.dumps(opts.faults),
    }


def record(opts: RecordOptions, progress: Callable[[str, int], None] | None = None) -> RecordSummary:
    """Record one iteration into `opts.out`; returns counts, bytes and seconds. Tests call this directly.

    `progress(phase, num_tensors)` is called after each captured tensor (phase: forward, backward, parameters).
    """
    from ..devices import resolve_device
    from ..faults import attach_faults, parse_fault
    from ..precision import apply_dtype, autocast_for
    from ..training import prepare, set_threads

    started = time.perf_counter()
    out = check_output(opts.out, opts.force)
    faults = [parse_fault(f) for f in opts.faults]
    select = module_selector(opts.include, opts.exclude)
    set_threads(opts.threads)
    device = resolve_device(opts.device)
    autocast = autocast_for(device, opts.amp)
    ref = IterationFile(opts.replay) if opts.replay else None
    try:
        bundle, built = _build(opts, ref)
    finally:
        if ref is not None:
            ref.close()
    apply_dtype(bundle, opts.dtype)
    setup = prepare(bundle, device, opts.optimizer)
    fault_handles = attach_faults(bundle.model, faults)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        result = _run_recorded(opts, setup, select, autocast, tmp, _meta(opts, device, built), progress)
        if out.exists() and not opts.force:
            raise OneIterError(f"output '{out}' appeared while recording; pass --force to overwrite it")
        os.replace(tmp, out)
    finally:
        for handle in fault_handles:
            handle.remove()
        if tmp.exists():
            tmp.unlink()
    num_entries, num_bytes, loss, num_calls = result
    return RecordSummary(out, num_entries, num_bytes, out.stat().st_size, time.perf_counter() - started, loss, num_calls)


def _run_recorded(opts, setup, select, autocast, tmp: Path, meta: dict, progress):
    import torch

    from ..training import train_step
    from .capture import ModuleCapture, TensorSink
    from .writer import BackgroundWriter

    model = setup.bundle.model
    writer = BackgroundWriter(tmp, meta, max_bytes=opts.queue_bytes)
    phase = ["forward"]
    sink = TensorSink(writer, on_capture=(lambda n: progress(phase[0], n)) if progress else None)
    try:
        _put_named(sink, writer, STATE_BEFORE, model.state_dict(keep_vars=True).items())
        for i, tensor in enumerate(setup.inputs):
            sink.put(BATCH, f"input.{i}", tensor)
        torch.manual_seed(opts.seed)

        def after_backward() -> None:
            phase[0] = "parameters"
            grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
            _put_named(sink, writer, PARAM_GRADS, grads)

        with ModuleCapture(model, sink, select) as capture:
            loss = train_step(
                setup, autocast=autocast, after_backward=after_backward,
                before_backward=lambda: phase.__setitem__(0, "backward"),
            )
        _put_named(sink, writer, STATE_AFTER, model.state_dict(keep_vars=True).items())
        sink.put("", LOSS, loss)
        num_entries, num_bytes = writer.close({"num_calls": capture.num_calls, "loss": float(loss.float())})
    except BaseException:
        writer.abort()
        raise
    return num_entries, num_bytes, float(loss.float()), capture.num_calls


def _put_named(sink, writer, group: str, named) -> None:
    names = []
    for name, tensor in named:
        sink.put(group, name, tensor, dedup=False)
        names.append(name)
    writer.attrs(group, {"order": names})
