"""A live one-line progress display on stderr for long runs (quiet when stderr is not a terminal)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from oneiter.cli.common import err

__all__ = ["live_status"]


@contextmanager
def live_status(title: str) -> Iterator[Callable[[str, int], None]]:
    """Yields `update(phase, count)`; shows `title: phase, N tensors` at most 10 times a second."""
    if os.environ.get("ONEITER_NO_PROGRESS") or not err.is_terminal:
        yield lambda _phase, _count: None
        return
    last = [0.0]
    with err.status(f"{title}: starting") as status:

        def update(phase: str, count: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1:
                last[0] = now
                status.update(f"{title}: {phase}, {count} tensors captured")

        yield update
