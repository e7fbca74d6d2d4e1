"""Shared CLI pieces: consoles (results to stdout, messages to stderr), the error-to-exit-code mapping.

Exit codes across oneiter: 0 success / match, 1 divergence found, 2 bad input (file, model, device, option,
an error in the user's own model code) — including recordings `compare` cannot judge (`inconclusive`: local
data, but no call's own error could be measured; `judge.verdict.EXIT_CODES`) — and 3 an internal error.
Set ONEITER_TRACEBACK=1 to see the full traceback instead of the one-line error.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Callable

import typer
from rich.console import Console

from oneiter.errors import OneIterError

__all__ = ["out", "err", "handle_errors", "EXIT_MATCH", "EXIT_DIVERGED", "EXIT_BAD_INPUT"]

EXIT_MATCH, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str) -> typer.Exit:
    """Print a one-line error to stderr and return the Exit(2) to raise."""
    err.print(f"[bold red]error:[/] {message}", markup=True)
    return typer.Exit(EXIT_BAD_INPUT)


# API parameter -> the CLI flag that sets it, where the names differ (otherwise `--` + the name, dashed)
FLAGS = {"faults": "--inject-fault", "replay": "--replay", "out": "--out"}


def cli_message(exc: BaseException) -> str:
    """The first line of an error, its leading API parameter name (`amp must be ...`) rewritten as the flag."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    param = getattr(exc, "param", None)
    if param and text.startswith(param) and text[len(param):len(param) + 1] in (" ", ":"):
        text = FLAGS.get(param, "--" + param.replace("_", "-")) + text[len(param):]
    return re.sub(r"\b([a-z][a-z_]*)=True\b", lambda m: "--" + m.group(1).replace("_", "-"), text)


def handle_errors(func: Callable) -> Callable:
    """Map known user errors (OneIterError, OSError on user files) to one line on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (OneIterError, OSError) as exc:
            if os.environ.get("ONEITER_TRACEBACK"):
                raise
            raise fail(cli_message(exc)) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper
