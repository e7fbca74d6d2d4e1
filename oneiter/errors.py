"""Typed errors and warnings. Anything a user can cause raises `OneIterError`; the CLI prints it as one line and
exits 2. Anything oneiter warns about goes through `warn`: a `OneIterWarning` (filter it, or turn it into an error,
like any Python warning) shown as one line, `warning: <message>`, without the file, line and source line Python's
default display adds, and above a running tqdm progress bar (a Trainer's) rather than inside it."""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Literal

__all__ = ["OneIterError", "FormatError", "DeviceError", "ModelError", "UserCodeError", "OneIterWarning", "warn",
           "one_line_warnings", "warning_line", "user_code", "user_frame", "innermost_user"]


class OneIterError(Exception):
    """A problem with the user's input (file, model, device, option). The message is one line, with the fix.

    `param` names the API parameter the message starts with (`amp must be one of ...`): library errors speak in
    parameters, and the CLI rewrites that leading name into its flag (`--amp must be one of ...`).
    """

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message)
        self.param = param


class FormatError(OneIterError):
    """A file is missing, not HDF5, truncated, incomplete, or not a oneiter file."""


class DeviceError(OneIterError):
    """A device name is unknown, its vendor plugin is missing, or the device is not present."""


class ModelError(OneIterError):
    """A model spec cannot be loaded, or does not follow the model contract."""


class UserCodeError(ModelError):
    """The user's own code (a model builder, a forward, a loss) raised: bad input, not a bug of oneiter."""


class OneIterWarning(UserWarning):
    """Something legal but misleading (a replay whose updates cannot be judged, a TensorBoard folder that already
    holds a comparison...): the run goes on, and the warning says what it changes."""


def warning_line(message, category: type = OneIterWarning) -> str:
    """A warning as one line: `warning: <message>` (another category than oneiter's and UserWarning is named)."""
    text = " ".join(str(message).split())
    named = issubclass(category, OneIterWarning) or category is UserWarning
    return f"warning: {text}" if named else f"warning: {text} ({category.__name__})"


def _above_bars(text: str) -> str:
    """What Python should write for a warning: `text`, or "" when a tqdm progress bar is running (a Trainer's), in
    which case `tqdm.write` has already put it above the bar, which it draws again."""
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None) if tqdm is not None else None
    if tqdm is None or not bars:
        return text
    try:
        tqdm.tqdm.write(text.rstrip("\n"), file=sys.stderr)
    except (OSError, ValueError, AttributeError):  # a closed stderr, another tqdm: Python writes it as usual
        return text
    return ""


def _format_oneiter(previous):
    def formatwarning(message, category, filename, lineno, line=None):
        if isinstance(category, type) and issubclass(category, OneIterWarning):
            return _above_bars(warning_line(message, category) + "\n")
        return previous(message, category, filename, lineno, line)

    formatwarning.oneiter = True  # type: ignore[attr-defined]  # a marker on the function, read by getattr below
    return formatwarning


def warn(message: str, *, stacklevel: int = 2) -> None:
    """Warn with a `OneIterWarning`, shown as one `warning:` line (see the module docstring). Only its display is
    changed (`warnings.formatwarning`, for oneiter's category alone): filters, `catch_warnings(record=True)` and
    `pytest.warns` see it as any warning."""
    if not getattr(warnings.formatwarning, "oneiter", False):
        warnings.formatwarning = _format_oneiter(warnings.formatwarning)
    warnings.warn(message, OneIterWarning, stacklevel=stacklevel + 1)


def _show_all(message, category, filename, lineno, file=None, line=None):
    text = _above_bars(warning_line(message, category) + "\n")
    try:
        (file if file is not None else sys.stderr).write(text)
    except (OSError, ValueError):  # a closed stderr: a warning is not worth an error
        pass


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """While active, *every* Python warning (torch's, the user's model's, oneiter's) is shown as one `warning:` line
    on stderr: what the CLI does, so its stderr holds no file:line and source-line pairs."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_all
        yield


def _frame_owner(filename: str) -> str:
    """'oneiter', 'library' (torch, the standard library: never the culprit's own frame) or 'user'."""
    import os
    import sysconfig

    path = os.path.abspath(filename)
    here = os.path.dirname(os.path.abspath(__file__))
    if path.startswith(here + os.sep):
        return "oneiter"
    stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"])
    parts = path.split(os.sep)
    in_stdlib = path.startswith(stdlib + os.sep) and "site-packages" not in parts
    if in_stdlib or "torch" in parts or filename.startswith("<"):
        return "library"
    return "user"


def user_frame(tb, *, calls_user: bool = False) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of the user's code in a traceback, or None when the error
    was raised in oneiter's own code (a bug) or nowhere in the user's.

    The user's code is their files and the libraries they call (Hugging Face's), and also torch's own module code
    running their model: a library frame of a module's `forward` (nn.Sequential feeding an nn.Linear the wrong
    width raises in torch's `Linear.forward`, under no line of the user's). `calls_user`: the traceback starts at
    oneiter code that called the user's function directly (a model builder, `make_optimizer`); an exception with no
    frame of oneiter's below that first one is the user's even where no frame is theirs (a `functools.partial` of
    a torch optimizer given a bad option raises in torch): its innermost frame is named then."""
    frames = []
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        owner = _frame_owner(code.co_filename)
        if owner == "library" and _runs_a_module(frame):
            owner = "module"
        frames.append((code.co_filename, tb.tb_lineno, code.co_name, owner))
        tb = tb.tb_next
    found = _innermost(frames)
    if found is None and calls_user and frames and not any(
            owner == "oneiter" and func not in _TRANSPARENT for _, _, func, owner in frames[1:]):
        return frames[-1][:3]
    return found


def _runs_a_module(frame) -> bool:
    """Whether `frame` is the `forward` of a torch.nn.Module (its `self`): torch's code running the user's model."""
    if frame.f_code.co_name != "forward":
        return False
    kind = type(frame.f_locals.get("self"))
    return any(c.__name__ == "Module" and c.__module__ == "torch.nn.modules.module" for c in kind.__mro__)


def innermost_user(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost of `frames` (outermost first: (file, line, function)) that is the user's own code; None when
    oneiter's own code comes first (a bug of oneiter) or no frame is the user's."""
    return _innermost([(*f, _frame_owner(f[0])) for f in frames])


def _innermost(frames: list[tuple[str, int, str, str]]) -> tuple[str, int, str] | None:
    """`innermost_user` of frames whose owner is known: (file, line, function, owner); owner `module` (torch's
    module code running the model) counts where no frame of the user's own lies between it and oneiter's."""
    module = None
    for depth, (filename, line, func, owner) in enumerate(reversed(frames)):
        if owner == "oneiter" and func in _TRANSPARENT and depth:
            continue  # oneiter's torch modes pass each op through: an op's error is the caller's (not one they raise)
        if owner == "oneiter":
            return module
        if owner == "user":
            return filename, line, func
        if owner == "module" and module is None:
            module = (filename, line, func)
    return module


_TRANSPARENT = {"__torch_dispatch__", "__torch_function__"}


class user_code:
    """`with user_code("the model's forward"):` — an exception of the user's own code becomes one `UserCodeError`
    line naming their frame (exit 2); oneiter's own errors and bugs pass through unchanged.

    `locate(exc, frame)`, when given, says more about where it was raised: None, or `(what, where)` — what raised
    (`the forward of layers.1.mlp@0`) and where, in words (`at file.py:31, in forward`). It may claim an error no
    user frame was found for (`frame` None): autograd's engine raises from C++ for a tensor the user's forward
    saved and then changed in place.
    """

    def __init__(self, what: str, locate: Callable[[BaseException, tuple | None], tuple[str, str] | None]
                 | None = None, *, calls_user: bool = False):
        self.what = what
        self.locate = locate
        self.calls_user = calls_user  # the block calls the user's function directly (see `user_frame`)

    def __enter__(self) -> "user_code":
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if exc is None or isinstance(exc, OneIterError) or not isinstance(exc, Exception):
            return False
        frame = user_frame(tb, calls_user=self.calls_user)
        place = self._place(exc, frame)
        if place is not None:
            what, where = place
        elif frame is not None:
            what, where = self.what, f"at {frame[0]}:{frame[1]}, in {frame[2]}"
        else:
            return False
        text = " ".join(str(exc).split())
        if place is not None:  # autograd's advice to rerun under anomaly detection: `locate` followed it already
            text = text.split(" Hint: enable anomaly detection")[0]
        text = text[:300]
        raise UserCodeError(f"{what} raised {type(exc).__name__}: {text} ({where}; ONEITER_TRACEBACK=1 shows the "
                            f"traceback)") from exc

    def _place(self, exc: BaseException, frame: tuple | None) -> tuple[str, str] | None:
        if self.locate is None:
            return None
        try:
            return self.locate(exc, frame)
        except Exception:  # noqa: BLE001 - finding the place must never hide the exception it describes
            return None
