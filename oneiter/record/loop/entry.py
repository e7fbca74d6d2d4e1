"""What a Recorder's block sets up as it starts, before any hook runs: the reference loaded into the model and its
optimizers (a replay), which local-error probe reruns each call, and which groups hold statistics only."""

from __future__ import annotations

from oneiter.errors import OneIterError, warn
from oneiter.format.optimizer_state import LOADED, OPTIMIZER_STATE, RECORDED, updates_not_judged
from oneiter.format.schema import BATCH, LOSS, OPTIMIZER, RANDOM, STATE_BEFORE
from oneiter.record.capture.batch import BatchSwap
from oneiter.record.capture.microbatches import reference_swaps
from oneiter.record.loop.given import amp_dtype, optimizer_names, param_dtype
from oneiter.record.options import RecordOptions
from oneiter.record.start.optimizer_start import load_start
from oneiter.record.start.reference import load_state

__all__ = ["load_reference", "probe_factory", "stats_groups"]


def load_reference(ref, model, optimizers: list, rank, start: bool) -> tuple[list[BatchSwap], str | None]:
    """Load the reference's weights, buffers and optimizer state into the model and its optimizers (not for a
    step that continues a multi-step replay: `start=False`); return the swaps that hand out its batch, one per
    microbatch, and the optimizer's start (`format/optimizer_state.py`; None when nothing was loaded)."""
    _check_world_size(ref, rank)
    if ref.steps():
        raise OneIterError(f"replay '{ref.path.name}' records {len(ref.steps())} steps: replay them with "
                           f"steps={len(ref.steps())} in an oneiter.StepRecorder (record --steps), or record "
                           f"one of them with --step",
                           param="replay")
    optimizer_start = None
    if start:
        _check_optimizer_given(ref, optimizers)
        load_state(model, ref)
        optimizer_start = load_start(optimizers, model, ref)
        why = updates_not_judged(str(ref.meta.get(OPTIMIZER_STATE) or ""), optimizer_start,
                                 optimizer_names(optimizers))
        if why:
            warn(why, stacklevel=4)
    return reference_swaps(ref), optimizer_start


def _check_optimizer_given(ref, optimizers) -> None:
    """A reference whose optimizer held state (Adam's moments, momentum) is replayed by an optimizer that loads it:
    without one, the target's optimizer steps from its own state and every updated weight differs."""
    if optimizers or str(ref.meta.get(OPTIMIZER_STATE) or "") not in (RECORDED, LOADED):
        return
    name = str(ref.meta.get("optimizer") or "optimizer")
    raise OneIterError(f"replay '{ref.path.name}' holds the state its {name} had at this step, and this replay was "
                       f"given no optimizer to load it into: pass optimizer= (the one that steps this iteration)",
                       param="optimizer")


def _check_world_size(ref, info) -> None:
    """A multi-rank reference is replayed with as many ranks (DDP averages gradients over all of them); one of its
    ranks replayed by a single process is allowed, with a warning (debugging one rank)."""
    theirs = int(ref.meta.get("world_size") or 1)
    if theirs <= 1 or theirs == info.world_size:
        return
    if info.distributed:
        raise OneIterError(f"replay {ref.path.name} was recorded with {theirs} ranks, this run has "
                           f"{info.world_size}: run torchrun with --nproc-per-node {theirs}", param="replay")
    warn(f"replaying one rank of a {theirs}-rank run in a single process: forward and backward compare as usual, "
         f"but param_grads and updated weights are not averaged and will differ", stacklevel=2)


def stats_groups(ref, start: bool):
    """At the stats level: which groups hold statistics only. Random values and the loss stay full; so do the
    batch, state_before and the optimizer's state, except in a replay (whose start is the reference's: its
    checksums prove it) and, for the start, in a step that continues a multi-step recording."""
    full = {RANDOM, "", LOSS} | ({BATCH} if ref is None else set())
    full |= {STATE_BEFORE, OPTIMIZER} if ref is None and start else set()
    return lambda group: group.split("/", 1)[0] not in full


def probe_factory(options: RecordOptions, ref, model, device, modes, notify):
    """Which local-error probe reruns each call: teacher forcing on replay, or against the CPU; with its kind
    (the file's `local` attribute). `notify`: where a note goes (None: nowhere)."""
    from oneiter.record.local.probe import against_cpu_factory, teacher_forced_factory  # imports torch

    settings = {"amp": amp_dtype(options.amp), "dtype": param_dtype(model), "calibrate": options.calibrate,
                "modes": modes}
    if options.against == "cpu":
        return against_cpu_factory(device, **settings), "against_cpu"
    if ref is None or not options.isolate:
        return None, ""
    if options.level == "stats" or ref.level == "stats":
        # local blame reruns each call on the reference's values: it needs full data
        if notify is not None:
            notify("level stats: no per-call local error (it needs full recordings of both sides); "
                   "`oneiter compare --suggest` names the region to record in full")
        return None, ""
    return teacher_forced_factory(ref, device, **settings), "teacher_forced"
