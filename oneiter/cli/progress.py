"""Progress on stderr for long runs: a live line on a terminal, plain lines anywhere else (a log file, CI, a job
scheduler), nothing with `--quiet` (or ONEITER_NO_PROGRESS=1).

Off a terminal a line is printed as each phase starts (forward, backward, probes, parameters, step, writing for a
record; each step's phase for a profile), then at most one every `EVERY` seconds with the count and the elapsed
time, so a log shows where minutes of work went without thousands of lines.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from oneiter.cli.common import err

__all__ = ["live_status", "PlainProgress", "EVERY", "shows_progress", "plain_line"]

EVERY = 5.0  # seconds between two plain lines of one phase


def shows_progress(quiet: bool) -> bool:
    return not quiet and not os.environ.get("ONEITER_NO_PROGRESS")


class PlainProgress:
    """Plain progress lines: `title: phase` when a phase starts, `title: phase, <what>, <N> s` at most every
    `every` seconds after; `clock` is for tests."""

    def __init__(self, title: str, write: Callable[[str], None], *, every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic):
        self.title, self.write, self.every, self.clock = title, write, every, clock
        self.started = clock()
        self.phase: Optional[str] = None
        self.last = self.started

    def __call__(self, phase: str, what: str = "") -> None:
        now = self.clock()
        if phase != self.phase:
            self.phase, self.last = phase, now
            self.write(f"{self.title}: {phase}{', ' + what if what else ''} ({now - self.started:.0f} s)")
        elif now - self.last >= self.every:
            self.last = now
            self.write(f"{self.title}: {phase}, {what} ({now - self.started:.0f} s)")


def plain_line(text: str) -> None:
    """One plain progress line on stderr."""
    err.print(text, markup=False, highlight=False)


@contextmanager
def live_status(title: str, *, quiet: bool = False) -> Iterator[Callable[[str, int], None]]:
    """Yields `update(phase, count)` (count: tensors captured so far): a live line at most 10 times a second on a
    terminal, plain lines elsewhere (see the module docstring), nothing when `quiet`."""
    if not shows_progress(quiet):
        yield lambda _phase, _count: None
        return
    if not err.is_terminal:
        plain = PlainProgress(title, plain_line)
        yield lambda phase, count: plain(phase, f"{count} tensors captured")
        return
    last = [0.0]
    with err.status(f"{title}: starting") as status:

        def update(phase: str, count: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1:
                last[0] = now
                status.update(f"{title}: {phase}, {count} tensors captured")

        yield update
