"""`StepDriver`: one optimizer step (or every K-th) of a framework's training run recorded from its own events.

Where it sits: the part the Trainer callback (`hf.py`) and the Lightning callback (`lightning.py`) share. A callback
builds one from its constructor's arguments (`callback_options`: a `RecordOptions`, or `oneiter.Recorder`'s
keywords, made one by `recording.settings`) and forwards its framework's events:

    driver.start_run(model, optimizers, options, max_steps)   # training starts (every=K: the multi-step file opens)
    rec = driver.begin(step, model, optimizers, make_options) # a step begins: its Recorder, or None
    driver.end()                                              # the step ended: its file is written
    driver.end_run(); driver.close()                          # training ended / an exception: nothing left open

`step=N` records optimizer step N (0-based, the framework's count of steps taken when it begins) in full with an
`oneiter.Recorder`; `every=K` records the statistics of steps 0, K, 2K, ... into one multi-step file
(`record/steps/step_recorder.py`). What the Recorder takes of a framework's step: docs/api.md.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Optional

from oneiter.errors import OneIterError
from oneiter.integrations.recording import open_steps, settings
from oneiter.record.options import RecordOptions
from oneiter.record.recorder import Recorder, RecordSummary
from oneiter.record.session import check_output
from oneiter.record.steps.step_recorder import StepRecorder
from oneiter.runtime.compiled import find_blocks, recordable_compiles
from oneiter.runtime.distributed import current_rank, rank_path

__all__ = ["StepDriver", "DrivenCallback", "callback_options", "meta_of"]

def callback_options(owner: str, *, step: Optional[int], every: Optional[int], options: Optional[RecordOptions],
                     keywords: dict[str, Any]) -> RecordOptions:
    """Callback `owner`'s (its class name, for errors) checked `RecordOptions`: which step (`step`, or `every`), and
    the recording's settings as `options` or as `oneiter.Recorder`'s keywords (`recording.settings`: the one place
    that builds an integration's settings)."""
    if (step is None) == (every is None):
        raise OneIterError("give step (one step, in full) or every (the statistics of every K-th step), not "
                           f"{'both' if step is not None else 'neither'}", param="step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise OneIterError(f"step must be a non-negative int, got {step!r}", param="step")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise OneIterError(f"every must be an int >= 1, got {every!r}", param="every")
    if "out" in keywords and not isinstance(keywords["out"], (str, os.PathLike)):
        raise OneIterError(f"out must be a file path, got {keywords['out']!r}", param="out")
    options = settings(owner, options, keywords)
    replay = options.replay
    if replay is not None and not (replay.is_file() or rank_path(replay, 0, 2).is_file()):
        raise OneIterError(f"replay must be an existing recording (.h5, or the .rank<R>.h5 files of a multi-rank "
                           f"run), got '{replay}'", param="replay")
    return options


class StepDriver:
    """The recording of step `step` (or of every `every`-th step) of one training run; `summary` holds what was
    written once it is done."""

    def __init__(self, options: RecordOptions, step: Optional[int], every: Optional[int]):
        self.options, self.step, self.every = options, step, every
        self.summary: Optional[RecordSummary] = None
        self._recorder: Optional[Recorder] = None  # step=N: the step being recorded
        self._steps: Optional[StepRecorder] = None  # every=K: the multi-step recording of the run
        self._block: Optional[AbstractContextManager] = None  # every=K: the step being recorded
        self._random: Optional[AbstractContextManager] = None  # a compiled model's random numbers, replayable
        self._open: Optional[Recorder] = None  # the Recorder of the step being recorded (either way)
        self.check_output()

    @property
    def out(self) -> Path:
        return self.options.out

    @property
    def replay(self) -> Optional[Path]:
        return self.options.replay

    def check_output(self) -> None:
        """Refuse an existing output (this rank's file) before training starts."""
        info = current_rank()
        check_output(rank_path(self.options.out, info.rank, info.world_size), self.options.force)

    def check_steps(self, max_steps: Optional[int], name: str = "steps") -> None:
        """A step past the run's last is refused before training starts (nothing would be recorded)."""
        if self.step is not None and max_steps and self.step >= max_steps:
            raise OneIterError(f"step must be below the run's {max_steps} {name}, got {self.step}: nothing would be "
                               f"recorded", param="step")

    def start_run(self, model, optimizers, options: RecordOptions, max_steps: Optional[int]) -> None:
        """Training starts: the output is checked again (the ranks are known now); with `every`, the multi-step
        file opens: the run's steps 0, K, 2K, ... below `max_steps` (a replay: the reference's)."""
        self.check_output()
        if find_blocks(model) and self._random is None:  # before the compiled code first compiles
            self._random = recordable_compiles()
            self._random.__enter__()
        if self.every is None:
            return
        self._steps = open_steps(model, options, every=self.every, max_steps=max_steps, optimizer=optimizers)

    def begin(self, step: int, model, optimizers, options: Callable[[], RecordOptions]) -> Optional[Recorder]:
        """Step `step` begins: if it is one to record, its Recorder's block (of `options()`) is entered and
        returned."""
        if self._steps is not None:
            if self._steps.next_step != step:
                return None
            block = self._steps.step(step)
            recorder = block.__enter__()
            self._block, self._open = block, recorder
            return recorder
        if step != self.step or self.summary is not None or self._recorder is not None:
            return None
        recorder = Recorder.from_options(model, options(), optimizer=optimizers)
        recorder.__enter__()
        self._recorder = self._open = recorder
        return recorder

    @property
    def current(self) -> Optional[Recorder]:
        """The Recorder of the step being recorded (its block open), or None: a step of several microbatches
        (gradient accumulation) hands each microbatch's batch to it."""
        return self._open if self.recording else None

    @property
    def recording(self) -> bool:
        """A step's block is open."""
        return self._block is not None or self._recorder is not None

    def end(self) -> None:
        """The step ended: its file (or its part of the multi-step file) is written."""
        self._open = None
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(None, None, None)
            return
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
            self.summary = recorder.summary

    def end_run(self) -> None:
        """Training ended: the multi-step file is complete (with the steps recorded so far)."""
        if self._steps is not None and self._block is None:
            steps, self._steps = self._steps, None
            steps.__exit__(None, None, None)
            self.summary = steps.summary
        self._end_random()

    def _end_random(self) -> None:
        random, self._random = self._random, None
        if random is not None:
            random.__exit__(None, None, None)

    def close(self) -> None:
        """Abandon whatever did not end (the framework raised inside a step): hooks removed, no file left."""
        failed = (RuntimeError, RuntimeError("the recorded step did not end"), None)
        self._open = None
        block, self._block = self._block, None
        try:
            if block is not None:
                block.__exit__(*failed)
        finally:
            steps, self._steps = self._steps, None
            recorder, self._recorder = self._recorder, None
            try:
                if steps is not None:
                    steps.__exit__(*failed)
            finally:
                self._end_random()
                if recorder is not None:
                    recorder.__exit__(*failed)


class DrivenCallback:
    """What a framework's recording callback (the Trainer's, Lightning's) shares: its constructor and `summary`; a
    callback subclasses it before its framework's callback class and forwards its events to `self._driver`.

    Args:
        step / every: the step to record in full, or every K-th step's statistics (one of them).
        options: the recording's settings, a `oneiter.record.options.RecordOptions` (`out`, `replay`, ...).
        **record: or the same settings as keywords, those `oneiter.Recorder` takes: `out` (required), `replay`,
            `include`/`exclude` (regexes on module paths), `seed` (`torch.manual_seed` when the step begins; None
            leaves the RNG alone), `isolate` (with `replay`: judge every call on the reference's values), `force`
            (overwrite `out`), `level`, ...; `model_name` is the file's `model`. Not `amp`: the framework's
            precision settings decide it (`integrations/recording.py`).

    After the step (or the run, with `every`), `summary` holds what was written.
    """

    def __init__(
        self,
        *,
        step: Optional[int] = None,
        every: Optional[int] = None,
        options: Optional[RecordOptions] = None,
        **record: Any,
    ):
        self.options = callback_options(type(self).__name__, step=step, every=every, options=options,
                                        keywords=record)
        self.step, self.every = step, every
        self.out, self.replay = self.options.out, self.options.replay
        self._driver = StepDriver(self.options, step, every)

    @property
    def summary(self) -> Optional[RecordSummary]:
        return self._driver.summary


def meta_of(framework: str, version: str, step: Optional[int], **more: Any) -> dict[str, Any]:
    """The root attributes a framework's callback adds to the file."""
    return {**more, **({"iteration": step} if step is not None else {}), "framework": framework,
            f"{framework}_version": version}
