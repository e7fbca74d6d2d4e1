"""A training framework's own steps under `oneiter profile`'s profiler, driven by the framework's step events.

Where it sits: the framework adapters (the mmengine `OneIterProfilerHook`, the Hugging Face and Lightning
`ProfileCallback`s) hold one `StepProfiler` each and forward their events; it drives a `session.ProfileSession`
(profiler, trace handler, module ranges, clock, overhead), so a framework's profile directory holds what `oneiter
profile` writes: one gzipped Chrome trace per cycle, the op, memory and module tables, `summary.json`.

    settings = ProfileSettings(schedule="wait=1,warmup=1,active=2", out_dir="prof")   # at construction
    profiler = StepProfiler(model, settings.options(...), settings.schedule, device, extra={...})
    profiler.start()                                    # training starts: the profiler is on
    profiler.begin_step(); ...step...; profiler.end_step()   # every step, while `profiler.wants_steps`
    profiler.end_run()                                  # training ended (early or not): summary.json complete

Steps: schedule step 0 is the first training step after `start()`. The profiler stops as soon as the schedule is
done; the next steps (as many as were recorded, at least 5) are timed without it, for the overhead and its noise
verdict (`overhead` in summary.json), which `oneiter profile diff` carries.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from oneiter.errors import OneIterError
from oneiter.profile.profile_session import ProfileSession
from oneiter.profile.runner import ProfileOptions
from oneiter.profile.schedule import DEFAULT_SCHEDULE, ProfileSchedule, parse_schedule
from oneiter.profile.summary import prepare_out_dir, write_summary
from oneiter.profile.tables import MEMORY_SORTS

__all__ = ["ProfileSettings", "StepProfiler", "schedule_of"]

_FLAGS = ("record_shapes", "profile_memory", "with_stack", "with_flops", "module_ranges", "force")  # the bools


def schedule_of(schedule: Union[str, Mapping[str, int], ProfileSchedule]) -> ProfileSchedule:
    """A schedule given as `'wait=1,warmup=1,active=2'`, a dict of those keys, or a `ProfileSchedule`."""
    try:
        if isinstance(schedule, ProfileSchedule):
            return schedule
        if isinstance(schedule, str):
            return parse_schedule(schedule)
        if isinstance(schedule, Mapping):
            return ProfileSchedule(**schedule)
    except (OneIterError, TypeError) as err:
        raise ValueError(f"schedule should be like '{DEFAULT_SCHEDULE}' or dict(wait=1, warmup=1, active=2), "
                         f"but got {schedule!r}: {err}") from None
    raise TypeError(f"schedule should be a str or a dict, but got {schedule!r}")


@dataclass(kw_only=True)
class ProfileSettings:
    """What a framework's profiling hook or callback is constructed with: the one list of its keywords (the mmengine
    `OneIterProfilerHook` and the `ProfileCallback`s take exactly these, `keywords_signature`), checked in
    mmengine's words ("should be X, but got Y"); `options()` adds what only the running framework knows."""

    schedule: Union[str, Mapping[str, int], ProfileSchedule] = DEFAULT_SCHEDULE
    """torch.profiler's vocabulary, `'wait=1,warmup=1,active=2'` or a dict (keys not given: wait=0, warmup=1,
    active=1, repeat=1, skip_first=0); held as a `ProfileSchedule`. One trace per cycle (`repeat`)."""
    out_dir: Optional[Union[str, os.PathLike]] = None
    """The profile directory (None: the framework's default, `oneiter_profile` in its output folder); held as a
    Path."""
    record_shapes: bool = False
    """torch.profiler's option: input shapes (the op table grouped by shape)."""
    profile_memory: bool = False
    """torch.profiler's option: allocations (the memory table)."""
    with_stack: bool = False
    """torch.profiler's option: Python stack frames in the trace."""
    with_flops: bool = False
    """torch.profiler's option: FLOPs of matmul/conv ops."""
    memory_sort: str = "self_cpu_memory"
    """The memory table's sort column, one of `tables.MEMORY_SORTS`."""
    module_ranges: bool = True
    """Forward/backward ranges per module path (the module table needs them)."""
    model_name: Optional[str] = None
    """The name in file names and summary.json (None: the model's class name)."""
    force: bool = False
    """Replace a previous oneiter profile in `out_dir`."""

    def __post_init__(self) -> None:
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} should be a bool, but got {getattr(self, name)!r}")
        if self.memory_sort not in MEMORY_SORTS:
            raise ValueError(f"memory_sort should be one of {', '.join(MEMORY_SORTS)}, but got {self.memory_sort!r}")
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir should be a directory path or None, but got {self.out_dir!r}")
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise TypeError(f"model_name should be a str or None, but got {self.model_name!r}")
        self.schedule = schedule_of(self.schedule)
        self.out_dir = None if self.out_dir is None else Path(self.out_dir)

    @property
    def profile_schedule(self) -> ProfileSchedule:
        """`schedule` as it is held (`__post_init__` made it a `ProfileSchedule`)."""
        return schedule_of(self.schedule)

    @property
    def profile_dir(self) -> Optional[Path]:
        """`out_dir` as it is held (`__post_init__` made it a Path), None: the framework's default."""
        return None if self.out_dir is None else Path(self.out_dir)

    @classmethod
    def given(cls, owner: str, settings: Mapping[str, Any]) -> "ProfileSettings":
        """The settings a constructor took as keywords (`**settings`); a keyword that is no field is refused, the
        error naming the constructor's class, `owner`."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}, but its keywords are "
                            f"{', '.join(names)}")
        return cls(**settings)

    @classmethod
    def keywords_signature(cls) -> inspect.Signature:
        """`(self, *, schedule=..., out_dir=None, ...)`: the signature of a constructor that takes these settings as
        its keywords and passes them on (`def __init__(self, **settings)`), for `help()` and editors to show."""
        keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                    for f in fields(cls)]
        return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *keywords])

    def check_fits(self, remaining: Optional[int], what: str = "iterations") -> None:
        """Refuse a schedule that needs more steps than the run has left (its active window would never come)."""
        schedule = self.profile_schedule
        if remaining is not None and schedule.num_steps > remaining:
            raise ValueError(f"schedule should fit in the training run, but {schedule} needs "
                             f"{schedule.num_steps} {what} and only {remaining} remain: its active window would "
                             f"never be reached")

    def options(self, model, *, out_dir: Path, batch_size: int, seed: int, amp: Optional[str],
                optimizer: str) -> ProfileOptions:
        """The `ProfileOptions` `oneiter profile` would have been given for this run (they name the traces and fill
        the summary's head)."""
        param = next(model.parameters(), None)
        return ProfileOptions(
            model=self.model_name or type(model).__name__, device=str(device_of(model)), batch_size=int(batch_size),
            seed=int(seed), dtype=str(param.dtype).removeprefix("torch.") if param is not None else "float32",
            amp=amp, optimizer=optimizer, schedule=str(self.schedule), out_dir=out_dir,
            memory_sort=self.memory_sort, measure_overhead=True, **{name: getattr(self, name) for name in _FLAGS},
        )  # fmt: skip


def device_of(model):
    import torch

    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class StepProfiler:
    """One profiling run over a framework's steps (see the module docstring). `log(level, message)` gets the line
    naming what was written ("info") and each warning ("warning")."""

    def __init__(self, model, options: ProfileOptions, schedule: ProfileSchedule,
                 extra: Optional[dict[str, Any]] = None, log: Optional[Callable[[str, str], None]] = None):
        self.model, self.options, self.schedule, self.extra, self.log = model, options, schedule, extra, log
        self.session: Optional[ProfileSession] = None
        self.summary: Optional[dict[str, Any]] = None  # summary.json's content once profiling started
        self._timing = False  # after the profiler stopped: timing plain steps for the overhead

    @property
    def out_dir(self) -> Path:
        return Path(self.options.out_dir)

    @property
    def wants_steps(self) -> bool:
        """Whether the next step is profiled or timed."""
        return self.session is not None and (self.session.profiling or self._timing)

    def start(self) -> None:
        out_dir = prepare_out_dir(self.out_dir, self.options.force)
        self.session = ProfileSession(self.model, self.options, self.schedule, device_of(self.model), out_dir,
                                      extra=self.extra)
        self.summary = self.session.summary
        self.session.start()

    def begin_step(self) -> None:
        if self.session is not None and self.wants_steps:
            self.session.begin_step()

    def end_step(self) -> None:
        session = self.session
        if session is None:
            return
        if session.profiling:
            session.end_step()
            if session.done:
                self._stop(session)
        elif self._timing:
            session.end_unprofiled_step()
            if len(session.unprofiled) >= session.unprofiled_wanted:
                self._timing = False
                session.finish()

    def end_run(self) -> None:
        """Training ended: a schedule or a timing left unfinished is said so, and summary.json is complete."""
        session = self.session
        if session is None:
            return
        if session.profiling:
            session.summary["warnings"].append(
                f"training ended after {session.step} of the schedule's {self.schedule.num_steps} steps: cycles not "
                "finished have no trace")
            self._stop(session)
        if self._timing:
            session.summary["notes"].append(
                f"training ended after {len(session.unprofiled)} of {session.unprofiled_wanted} unprofiled steps: "
                "the overhead rests on those")
            self._timing = False
            session.finish()

    def close(self) -> None:
        """After an exception in training: the profiler stopped, without hiding that exception."""
        if self.session is not None and self.session.profiling:
            self.session.stop(failed=True)

    def _stop(self, session: ProfileSession) -> None:
        session.stop()
        self._timing = session.unprofiled_wanted > 0
        write_summary(session.out_dir, session.summary)  # the traces are complete; the overhead comes later
        if not self._timing:
            session.finish()
        if self.log is not None:
            traces = [c["trace"] for c in session.summary["cycles"]]
            self.log("info", f"oneiter: profiled {len(traces)} cycle(s) into {session.out_dir}: {', '.join(traces)}")
            for warning in session.summary["warnings"]:
                self.log("warning", f"oneiter profile: {warning}")
