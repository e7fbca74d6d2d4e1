"""Whether the output's filesystem can hold the recording: checked before the block starts (the model's state and
gradients it stores in full) and again once forward is done (forward measured, backward estimated)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from oneiter.errors import OneIterError
from oneiter.runtime.names import state_tensors
from oneiter.runtime.sharding import shard_of

__all__ = ["state_bytes", "check_room", "check_space", "estimate", "forward_done", "same_file", "size_text"]


def state_bytes(model, level: str, replay: bool) -> int:
    """The bytes the file stores of the model's state: state_before (full unless a stats-level replay), and at the
    full level state_after and the parameter gradients; a sharded (FSDP2) tensor as this rank's shard."""
    state = sum(shard_of(t).numel() * t.element_size() for _, t, _ in state_tensors(model))
    params = sum(shard_of(p).numel() * p.element_size() for p in model.parameters())
    before = state if level == "full" or not replay else 0
    return before + (state + params if level == "full" else 0)


def check_room(out: Path, replay: Path | None, model, level: str) -> int:
    """Before the block: `out` is not the reference being replayed, and its filesystem holds at least what the file
    stores of the model's state (`state_bytes`, returned)."""
    needed = state_bytes(model, level, replay is not None)
    check_space(out, needed, "at least (the model's state and gradients it stores in full)")
    if replay is not None and same_file(replay, out):
        raise OneIterError(f"out '{out}' is the reference being replayed; write the replay elsewhere", param="out")
    return needed


def forward_done(out: Path, num_bytes: int, before_bytes: int, state: int, notify) -> int:
    """Forward is done (`num_bytes` queued so far): the whole file estimated (`estimate`, returned; said to `notify`
    unless it is None); refused now if the output's filesystem cannot hold it."""
    estimated = estimate(num_bytes, before_bytes, state)
    if notify is not None:
        notify(f"forward recorded: the file will be about {size_text(estimated)}")
    check_space(out, estimated - num_bytes, "about (forward measured, backward estimated)", written=num_bytes)
    return estimated


def estimate(num_bytes: int, before_bytes: int, state: int) -> int:
    """The whole file, once forward is done: what was queued so far (`num_bytes`), as much again for the gradients
    of the same tensors, and state_after and the parameter gradients (`state` less what `before_bytes` stored)."""
    later = state - before_bytes  # state_after and parameter gradients, still to come
    forward = max(num_bytes - before_bytes, 0)  # what forward wrote (and the batch)
    # backward stores the gradients of what forward stored: measured 1.3-1.45x forward's bytes on resnet18
    return int(num_bytes + 1.5 * forward + later)


def size_text(nbytes: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def check_space(out: Path, needed: int, how: str, written: int = 0) -> None:
    """Refuse when the filesystem of `out` has less free space than `needed` more bytes."""
    try:
        free = shutil.disk_usage(out.parent).free
    except OSError:
        return
    if free < needed:
        raise OneIterError(f"out '{out}' needs {how} {size_text(needed + written)}, and '{out.parent}' has "
                           f"{size_text(free + written)} free: free space, write elsewhere, or record less "
                           f"(include/exclude)", param="out")


def same_file(a: Path, b: Path) -> bool:
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
