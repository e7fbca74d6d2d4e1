"""The profiling schedule: parse `--schedule wait=1,warmup=1,active=2`, check it, and count the steps it needs.

First stage of `oneiter profile`: the runner asks `ProfileSchedule.num_steps` how many training iterations to run
(exactly that many: no silent extra steps, no window left unreached) and hands `torch_schedule()` to
torch.profiler. The vocabulary is torch.profiler's (`wait`, `warmup`, `active`, `repeat`, `skip_first`), with two
differences that make every schedule finite and reachable:

- `repeat` defaults to 1 and must be at least 1 (torch's `repeat=0` means "cycle forever");
- `active` must be at least 1, and a schedule needing more than `max_steps` iterations is refused, since its
  active window would in practice never be reached (a typo such as `skip_first=1000` for `skip_first=10`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from oneiter.errors import OneIterError

__all__ = ["ScheduleError", "ProfileSchedule", "parse_schedule", "DEFAULT_SCHEDULE", "DEFAULT_MAX_STEPS"]

DEFAULT_SCHEDULE = "wait=1,warmup=1,active=2"
DEFAULT_MAX_STEPS = 100


class ScheduleError(OneIterError):
    """A `--schedule` string is malformed, or its active window can never be reached."""


@dataclass(frozen=True)
class ProfileSchedule:
    """One profiling cycle is `wait` idle steps, `warmup` steps with the profiler on but discarded, then `active`
    recorded steps; the cycle runs `repeat` times after `skip_first` idle steps."""

    wait: int = 0
    """Steps per cycle that run without the profiler."""
    warmup: int = 1
    """Steps per cycle with the profiler started but their events discarded (profiler start-up cost)."""
    active: int = 1
    """Recorded steps per cycle: one trace covers them."""
    repeat: int = 1
    """Number of cycles, so number of traces."""
    skip_first: int = 0
    """Steps skipped once before the first cycle (e.g. the first, slow iteration)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"schedule {f.name} must be an integer >= 0, got {value!r}")
        if self.active < 1:
            raise ScheduleError(
                f"schedule active={self.active}: the active window is never reached, nothing would be recorded; "
                "use active=1 or more"
            )
        if self.repeat < 1:
            raise ScheduleError(
                f"schedule repeat={self.repeat}: oneiter runs a finite number of steps, expected repeat >= 1"
            )

    @property
    def cycle_len(self) -> int:
        """Steps in one cycle: wait + warmup + active."""
        return self.wait + self.warmup + self.active

    @property
    def num_steps(self) -> int:
        """Training iterations the schedule needs: the last one is the last active step of the last cycle."""
        return self.skip_first + self.repeat * self.cycle_len

    def active_steps(self, cycle: int) -> list[int]:
        """The 0-based step numbers recorded in `cycle` (0-based): torch's `ProfilerStep#N` labels."""
        first = self.skip_first + cycle * self.cycle_len + self.wait + self.warmup
        return list(range(first, first + self.active))

    def phase(self, step: int) -> str:
        """What the profiler does at 0-based `step`: 'skip', 'wait', 'warmup' or 'active' ('done' past the end)."""
        if step >= self.num_steps:
            return "done"
        if step < self.skip_first:
            return "skip"
        position = (step - self.skip_first) % self.cycle_len
        if position < self.wait:
            return "wait"
        return "warmup" if position < self.wait + self.warmup else "active"

    def check_budget(self, max_steps: int) -> None:
        """Refuse a schedule whose active window lies beyond `max_steps` iterations."""
        if self.num_steps > max_steps:
            first_active = self.active_steps(0)[0]
            raise ScheduleError(
                f"schedule {self} needs {self.num_steps} steps (first active step {first_active}), "
                f"more than --max-steps {max_steps}: its active window is never reached; "
                "lower skip_first/wait/repeat or raise --max-steps"
            )

    def torch_schedule(self):
        """The equivalent `torch.profiler.schedule` callable."""
        import torch.profiler

        return torch.profiler.schedule(
            wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat, skip_first=self.skip_first
        )

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def parse_schedule(text: str) -> ProfileSchedule:
    """`'wait=1,warmup=1,active=2'` -> ProfileSchedule; keys not given keep their defaults
    (wait=0, warmup=1, active=1, repeat=1, skip_first=0)."""
    known = {f.name for f in fields(ProfileSchedule)}
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ScheduleError(
                f"--schedule expects KEY=VALUE with KEY in {', '.join(sorted(known))}, got '{item}' "
                f"(example: {DEFAULT_SCHEDULE})"
            )
        if key in values:
            raise ScheduleError(f"--schedule gives '{key}' twice in '{text}'")
        try:
            values[key] = int(raw.strip())
        except ValueError:
            raise ScheduleError(f"--schedule {key} must be an integer, got '{raw.strip()}'") from None
    return ProfileSchedule(**values)
