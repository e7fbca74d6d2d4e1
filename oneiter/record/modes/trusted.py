"""Whether the code running now is a *trusted recomputation* rather than the target's own computation.

Where this sits: the local-error probes (`probe.py`) recompute module calls to calibrate the expected noise of
a precision (on the CPU, in float64 and in the run's precision) or, with `--against cpu`, to get a float32
reference. Those recomputations run the model's own Python code — a wrapped `forward`, a patched class, a
replaced torch function are all part of it, on purpose — but not what stands for the *device*: faults injected
with `--inject-fault` (they simulate a wrong device kernel) and `--fallback` (it moves the target's ops to the
CPU). Both check `active()` and step aside while a trusted recomputation runs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["active", "running"]

_state = threading.local()


def active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextmanager
def running(enabled: bool = True) -> Iterator[None]:
    """Mark the block as a trusted recomputation (no-op when `enabled` is False)."""
    if not enabled:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
