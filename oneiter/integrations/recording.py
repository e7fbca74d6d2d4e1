"""What every framework integration shares: its settings (one `RecordOptions`), which steps it records, and the
`Recorder` or `StepRecorder` it opens for them.

The pattern, followed by the mmengine Runner hook (`mmengine.py`) and, through their shared `step_driver.py`, the
Hugging Face Trainer callback (`hf.py`) and the PyTorch Lightning callback (`lightning.py`); a new framework is one
more module on the same lines:

1. **Construct**: which step to record — one step in full (`step=N`; mmengine says `iteration`) or the statistics
   of every K-th step (`every=K`: a multi-step file) — and the recording's settings, as one `RecordOptions`
   (`options=`) or as its keywords, the ones `oneiter.Recorder` takes (`out=`, `replay=`, `include=`, `seed=`,
   `isolate=`, `force=`, `level=`, ...; `model_name=` names the file's `model`). `settings()` turns either into
   one checked `RecordOptions` with what the framework decides set by the integration, never by the user: the
   framework enters autocast itself (`manage_autocast=False`; `amp` is read from the framework at the step), and
   what the framework feeds the model but is no part of it is skipped (mmengine's data preprocessor). Check
   `out` (never overwritten unless `force`) and `replay` (an existing file) here, before training starts, in the
   framework's error convention.
2. **When training starts**: with `every`, `open_steps(model, for_step(...), ...)` opens the multi-step file
   (a `StepRecorder` without a twin: a framework's step cannot be run again) over the run's steps 0, K, 2K, ...
   (a replay: the reference's).
3. **At the step**: a `Recorder` of `for_step(options, amp=..., meta=...)` (`Recorder.from_options`), or the
   multi-step file's `step(s)` block, entered when the framework's step begins and left when it ends: the run's
   autocast dtype, and what only the framework knows in the file's root attributes (batch size, seed, version).
   When the framework raises inside the step and calls nothing more, leave it with the exception (no file).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Iterable, Optional

from oneiter.errors import OneIterError
from oneiter.record.options import RecordOptions, amp_name
from oneiter.record.steps.step_recorder import StepRecorder

__all__ = ["settings", "for_step", "open_steps", "KEYWORDS", "FRAMEWORK_OWNED"]

FRAMEWORK_OWNED = ("amp", "manage_autocast")
"""`RecordOptions` fields the framework decides (its own autocast), never given to an integration."""
KEYWORDS = frozenset(f.name for f in fields(RecordOptions)) - set(FRAMEWORK_OWNED) | {"model_name"}
"""The recording keywords an integration takes: `oneiter.Recorder`'s, `model_name` for `name`."""


def settings(owner: str, options: Optional[RecordOptions], keywords: dict[str, Any], *,
             skip: Iterable[str] = ()) -> RecordOptions:
    """One checked `RecordOptions` for integration `owner` (its class name, for errors): `options`, or one built
    from `keywords`; the framework's own autocast (`FRAMEWORK_OWNED`) and `skip`ped module paths set here."""
    if options is not None and keywords:
        raise OneIterError(f"{owner} takes options= or the recording's keywords ({', '.join(sorted(keywords))}), "
                           f"not both", param="options")
    if options is None:
        unknown = sorted(set(keywords) - KEYWORDS)
        owned = [name for name in unknown if name in FRAMEWORK_OWNED]
        if owned:
            raise OneIterError(f"{owned[0]} is the training framework's own (its autocast settings), not {owner}'s",
                               param=owned[0])
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument '{unknown[0]}'")
        if "out" not in keywords:
            raise TypeError(f"{owner}() missing required keyword argument: 'out'")
        given = dict(keywords)
        if "model_name" in given:
            given["name"] = given.pop("model_name")
        options = RecordOptions(**given)
    elif not isinstance(options, RecordOptions):
        raise OneIterError(f"options must be a RecordOptions, got {type(options).__name__}", param="options")
    elif options.amp is not None:
        raise OneIterError(f"amp is the training framework's own (its autocast settings), not {owner}'s: leave "
                           f"it None", param="amp")
    return replace(options, manage_autocast=False, skip=(*options.skip, *(s for s in skip if s not in options.skip)))


def for_step(options: RecordOptions, *, amp: Optional[str], meta: dict[str, Any]) -> RecordOptions:
    """The settings of one recorded step: the run's autocast dtype, and what only the framework knows over the
    user's own `meta`."""
    return replace(options, amp=amp_name(amp), meta={**options.meta, **meta})


def open_steps(model, options: RecordOptions, *, every: int, max_steps: Optional[int], optimizer) -> StepRecorder:
    """`every=K`: the multi-step recording of the run's steps 0, K, 2K, ... below `max_steps` (a replay: the
    reference's steps), of `options` (`for_step`'s: the run's autocast and metadata), entered; no twin (the
    framework's step cannot be run again)."""
    wanted = None if options.replay is not None else list(range(0, max(int(max_steps or 1), 1), every))
    steps = StepRecorder.from_options(model, options, wanted, optimizer=optimizer, twin=False)
    steps.__enter__()
    return steps
