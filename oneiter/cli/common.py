"""Shared CLI pieces: consoles (results to stdout, messages to stderr), the error-to-exit-code mapping.

Exit codes across oneiter: 0 success / match, 1 divergence found, 2 bad input (file, model, device, option,
an error in the user's own model code) — including recordings `compare` cannot judge (`inconclusive`: local
data, but no call's own error could be measured, or a calibration not trusted;
`judge.iteration.verdict.EXIT_CODES`) — and 3 an internal error (a bug of oneiter: any other exception). Each error
is one line on stderr; set ONEITER_TRACEBACK=1 to print the full traceback before it (the exit code stays the
same). A closed output pipe (`oneiter compare a b | head`) is not
an error: the command exits quietly with the code of what it had decided (`set_outcome`), else 0.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import traceback
from typing import Callable

import typer
from rich.console import Console

from oneiter.errors import OneIterError, one_line_warnings
from oneiter.runtime.commands import PARAMS

__all__ = ["out", "err", "handle_errors", "set_outcome", "terminal_text", "EXIT_MATCH", "EXIT_DIVERGED",
           "EXIT_BAD_INPUT", "EXIT_INTERNAL", "ISSUES"]

EXIT_MATCH, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
ISSUES = "the oneiter issue tracker"

class OutputConsole(Console):
    """A rich Console whose closed output pipe raises BrokenPipeError for `handle_errors` to turn into the
    command's exit code (rich's own `on_broken_pipe` exits with 1, which would read as a divergence)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(32, "the reader of the output went away")


out = OutputConsole(highlight=False, soft_wrap=True)
err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)


def terminal_text(text: str) -> str:
    """`report.terminal.safe_text`: text from a file with control characters shown as visible escapes."""
    from oneiter.report.terminal import safe_text

    return safe_text(text)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print a one-line error to stderr and return the Exit(code) to raise."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(terminal_text(message))}", markup=True)
    return typer.Exit(code)


_outcome: list[int] = []


def set_outcome(code: int) -> None:
    """The exit code a command has decided on (compare's verdict) before it prints: used if the output pipe closes."""
    _outcome[:] = [code]


def _quiet_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so later writes and the final flush don't fail
    (the recipe of the Python docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file descriptor (tests' runners)
        pass




def cli_message(exc: BaseException) -> str:
    """The first line of an error, its leading API parameter name (`amp must be ...`) rewritten as the flag."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    param = getattr(exc, "param", None)
    if param and text.startswith(param) and text[len(param):len(param) + 1] in (" ", ":"):
        text = PARAMS.get(param, "--" + param.replace("_", "-")) + text[len(param):]
    return re.sub(r"\b([a-z][a-z_]*)=True\b", lambda m: "--" + m.group(1).replace("_", "-"), text)


def _pass_through() -> tuple[type[BaseException], ...]:
    """What commands raise on purpose for typer to handle: Exit (the exit code), Abort, usage errors."""
    import typer.exceptions

    kinds: list[type[BaseException]] = [typer.Exit, typer.Abort, typer.exceptions.TyperException]
    try:
        import click

        kinds += [click.exceptions.Exit, click.exceptions.Abort, click.ClickException]
    except ImportError:  # typer >= 0.2x vendors click
        pass
    return tuple(kinds)


_PASS_THROUGH = _pass_through()


def internal_message(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:300]
    return (f"internal error: {type(exc).__name__}: {text} — please report it at {ISSUES}; "
            f"ONEITER_TRACEBACK=1 shows the traceback")


def handle_errors(func: Callable) -> Callable:
    """Map errors to exit codes: user errors (OneIterError, OSError on user files) to one line on stderr and 2,
    anything else (a bug) to one line and 3, a closed stdout pipe to a quiet exit (see the module docstring);
    Python warnings to one `warning:` line each."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        _outcome.clear()
        try:
            with one_line_warnings():  # every warning, torch's and the model's too: one `warning:` line
                return func(*args, **kwargs)
        except _PASS_THROUGH:
            raise  # typer.Exit (a command's own exit code), usage errors: typer reports them
        except BrokenPipeError:
            _quiet_stdout()
            raise typer.Exit(_outcome[0] if _outcome else EXIT_MATCH) from None
        except SystemExit as exc:  # a plain rich Console's on_broken_pipe
            if not isinstance(exc.__context__, BrokenPipeError):
                raise
            _quiet_stdout()
            raise typer.Exit(_outcome[0] if _outcome else EXIT_MATCH) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None
        except (OneIterError, OSError) as exc:
            _traceback()
            raise fail(cli_message(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a bug of oneiter: exit 3, never a bare traceback
            _traceback()
            raise fail(internal_message(exc), EXIT_INTERNAL) from None

    return wrapper


def _traceback() -> None:
    if os.environ.get("ONEITER_TRACEBACK"):
        err.file.write(traceback.format_exc())
        err.file.flush()
