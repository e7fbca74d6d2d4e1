"""A training framework's own steps under `oneiter profile`'s profiler, driven by the framework's step events.

Where it sits: the framework adapters (the mmengine `OneIterProfilerHook`, the Hugging Face and Lightning
`ProfileCallback`s) hold one `StepProfiler` each and forward their events; it drives a `session.ProfileSession`
(profiler, trace handler, module ranges, clock, overhead), so a framework's profile directory holds what `oneiter
profile` writes: one gzipped Chrome trace per cycle, the op, memory and module tables, `summary.json`.

    settings = ProfileSettings.checked(schedule="wait=1,warmup=1,active=2", out_dir="prof")   # at construction
    profiler = StepProfiler(model, settings.options(...), settings.schedule, device, extra={...})
    profiler.start()                                    # training starts: the profiler is on
    profiler.begin_step(); ...step...; profiler.end_step()   # every step, while `profiler.wants_steps`
    profiler.end_run()                                  # training ended (early or not): summary.json complete

Steps: schedule step 0 is the first training step after `start()`. The profiler stops as soon as the schedule is
done; the next steps (as many as were recorded, at least 5) are timed without it, for the overhead and its noise
verdict (`overhead` in summary.json), which `oneiter profile diff` carries.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from oneiter.errors import OneIterError
from oneiter.profile.runner import ProfileOptions
from oneiter.profile.schedule import DEFAULT_SCHEDULE, ProfileSchedule, parse_schedule
from oneiter.profile.session import ProfileSession
from oneiter.profile.summary import prepare_out_dir, write_summary
from oneiter.profile.tables import MEMORY_SORTS

__all__ = ["ProfileSettings", "StepProfiler", "schedule_of"]

_FLAGS = ("record_shapes", "profile_memory", "with_stack", "with_flops", "module_ranges", "force")


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


@dataclass
class ProfileSettings:
    """What a framework's profiling hook or callback is constructed with, checked (mmengine's words: "should be X,
    but got Y"); `options()` adds what only the running framework knows."""

    schedule: ProfileSchedule
    out_dir: Optional[Path]
    flags: dict[str, bool]  # record_shapes, profile_memory, with_stack, with_flops, module_ranges, force
    memory_sort: str
    model_name: Optional[str]

    @classmethod
    def checked(cls, *, schedule: Union[str, Mapping[str, int], ProfileSchedule] = DEFAULT_SCHEDULE,
                out_dir: Optional[Union[str, os.PathLike]] = None, memory_sort: str = "self_cpu_memory",
                model_name: Optional[str] = None, **flags: bool) -> "ProfileSettings":
        for name, value in flags.items():
            if name not in _FLAGS:
                raise TypeError(f"unexpected keyword {name!r}: the flags are {', '.join(_FLAGS)}")
            if not isinstance(value, bool):
                raise TypeError(f"{name} should be a bool, but got {value!r}")
        if memory_sort not in MEMORY_SORTS:
            raise ValueError(f"memory_sort should be one of {', '.join(MEMORY_SORTS)}, but got {memory_sort!r}")
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir should be a directory path or None, but got {out_dir!r}")
        if model_name is not None and not isinstance(model_name, str):
            raise TypeError(f"model_name should be a str or None, but got {model_name!r}")
        return cls(schedule_of(schedule), None if out_dir is None else Path(out_dir),
                   {name: bool(flags.get(name, name == "module_ranges")) for name in _FLAGS}, memory_sort, model_name)

    def check_fits(self, remaining: Optional[int], what: str = "iterations") -> None:
        """Refuse a schedule that needs more steps than the run has left (its active window would never come)."""
        if remaining is not None and self.schedule.num_steps > remaining:
            raise ValueError(f"schedule should fit in the training run, but {self.schedule} needs "
                             f"{self.schedule.num_steps} {what} and only {remaining} remain: its active window would "
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
            memory_sort=self.memory_sort, measure_overhead=True, **self.flags,
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
        if self.wants_steps:
            self.session.begin_step()

    def end_step(self) -> None:
        session = self.session
        if session is None:
            return
        if session.profiling:
            session.end_step()
            if session.done:
                self._stop()
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
            self._stop()
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

    def _stop(self) -> None:
        session = self.session
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
