"""Keep Kineto's native log lines out of the user's terminal.

Kineto prints `USDT: ... profiler_start` / `profiler_stop` (and `STAGE:` lines in older builds) straight to the
process's file descriptors on every profiler start and stop, below Python, so `sys.stderr` redirection does not
catch them. `native_output_filtered()` points fd 1 and fd 2 at a temporary file around the profiler's start, step
and stop calls, then writes back every captured line that is not known noise: a real warning is delayed by one
step, never lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

__all__ = ["NOISE", "native_output_filtered", "quiet_kineto_env"]

# Lines dropped from the captured output: Kineto's start/stop chatter, and the allocator's note that tensors made
# before profiling started will have no matching free event (always true here: the model exists before the trace).
NOISE = re.compile(
    r"^(USDT:|STAGE:)|ActivityProfilerController|CuptiActivityProfiler|libkineto"
    r"|Memory block of unknown size was allocated before the profiling started"
)


def quiet_kineto_env() -> None:
    """Ask Kineto to log nothing below fatal (read when Kineto initialises; a user's own KINETO_LOG_LEVEL wins)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no libc symbols (unusual platform): Python-level flush is all we can do
        pass


@contextlib.contextmanager
def native_output_filtered(enabled: bool = True):
    """Capture fds 1 and 2 for the duration of the block; replay non-noise lines to where they were going."""
    if not enabled:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _flush_c_stdio()
    try:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
    except OSError:  # a closed stdout/stderr (daemons): nothing reaches a terminal anyway
        yield
        return
    captured = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    try:
        for fd, tmp in captured.items():
            os.dup2(tmp.fileno(), fd)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _flush_c_stdio()
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)
        for fd, tmp in captured.items():
            _replay(tmp, fd)
            tmp.close()


def _replay(tmp, fd: int) -> None:
    tmp.seek(0)
    kept = [line for line in tmp.read().decode("utf-8", "replace").splitlines(True) if not NOISE.search(line)]
    if kept:
        os.write(fd, "".join(kept).encode("utf-8"))
