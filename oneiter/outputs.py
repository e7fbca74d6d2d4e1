"""Where oneiter's outputs go: every file or folder a command writes is resolved here before anything is written.

A report path may be a plain file name, `-` (stdout, for `--json` and `--csv`), a symlink (to a file, to
`/proc/self/fd/1`: that is what `/dev/stdout` is), a character device (`/dev/null`, a terminal) or a FIFO. Writing
a report into a temporary file and renaming it over the target is right for a regular file (a full disk leaves the
previous report, never half of one) and wrong for everything else: renamed over `/dev/stdout` as root, it turns
the system's `/dev/stdout` into a regular file and the JSON never reaches stdout. So `resolve` follows the path
link by link first and says what it is (`Destination.kind`):

- `file`: a regular file, or a name that does not exist yet in an existing folder; written whole or not at all
  (a temporary file beside the *resolved* target, renamed over it: a symlink to a file stays a symlink);
- `stdout` / `stderr`: `-`, or a path naming this process's own descriptor 1 or 2 (`/dev/stdout`,
  `/proc/self/fd/1`, a symlink to either): written through `sys.stdout`/`sys.stderr`, in order with the rest;
- `stream`: a character device, a FIFO, another descriptor (`/dev/fd/3`, `/proc/<pid>/fd/<n>`): opened for
  writing as it is (no temporary file, no rename, never created or truncated) and written directly;

and refuses, with one line naming the option (`OutputError`, exit 2), a directory, a block device, a socket, a
path whose folder does not exist, a dangling link chain and a link loop. Folders (`--tensorboard`, `profile -o`)
go through `resolve_folder`; files oneiter writes inside its own folders through `file_in`, which refuses a name
that is already something other than a regular file (a symlink planted in a profile folder is never followed).
Recordings (`record -o`) are HDF5 and need a seekable regular file: `resolve(..., streams=False)` refuses the rest.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from oneiter.errors import OneIterError

__all__ = ["Destination", "OutputError", "resolve", "resolve_folder", "file_in", "open_text", "write_text",
           "atomic_text", "atomic_path", "destination", "check_distinct", "STDOUT"]

STDOUT = "-"
_MAX_LINKS = 40  # as the kernel's own limit on symlinks followed in one lookup
# descriptors named as paths: /dev/stdout|stderr|stdin, /dev/fd/N, /proc/self|thread-self|<pid>/fd/N
_DEV_STD = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_FD_PATH = re.compile(r"^/(?:dev/fd|proc/(?P<who>self|thread-self|\d+)(?:/task/\d+)?/fd)/(?P<fd>\d+)$")


class OutputError(OneIterError):
    """An output path oneiter will not write to (a directory, a block device, a missing folder, a link loop...)."""


@dataclass(frozen=True)
class Destination:
    """A resolved output: `kind` (file, stdout, stderr, stream), the path to write (the resolved target of a
    file or stream), the descriptor for `stream`s named by number, and what the user gave."""

    kind: str
    given: str
    path: Path | None = None
    fd: int | None = None

    @property
    def to_stdout(self) -> bool:
        return self.kind == "stdout"

    @property
    def is_file(self) -> bool:
        return self.kind == "file"

    def __str__(self) -> str:
        return self.given


def _refuse(option: str, given: str, why: str) -> OutputError:
    """`--json 'x': why`; an API parameter name (`out`) is kept for the CLI to rewrite into its flag."""
    return OutputError(f"{option} '{given}': {why}", param=None if option.startswith("-") else option)


def _own_fd(path: str) -> int | None:
    """The descriptor a path names when it is one of this process's own (`/dev/stdout`, `/proc/self/fd/1`,
    `/proc/<our pid>/fd/3`, `/dev/fd/3`); None for any other path (another process's descriptors included)."""
    if path in _DEV_STD:
        return _DEV_STD[path]
    match = _FD_PATH.match(path)
    if match is None:
        return None
    who = match["who"]
    if who is None or who in ("self", "thread-self") or int(who) == os.getpid():
        return int(match["fd"])
    return None


def _is_fd_path(path: str) -> bool:
    return path in _DEV_STD or _FD_PATH.match(path) is not None


def resolve(given: str | os.PathLike, option: str, *, stdout_ok: bool = False, streams: bool = True,
            inputs: tuple = ()) -> Destination:
    """What writing to `given` would write to (see the module docstring); `stdout_ok`: `-` means stdout;
    `streams`: devices, FIFOs and descriptors are accepted (False: a regular file only, as HDF5 needs);
    `inputs`: files the command reads, which an output must never replace."""
    text = os.fspath(given)
    if text == STDOUT:
        if stdout_ok:
            return Destination("stdout", text)
        raise _refuse(option, text, "'-' (stdout) is taken by --json and --csv only; give a file name (./- for a "
                                    "file named '-')")
    if text == "":
        raise _refuse(option, "", "an empty path")
    at = os.path.abspath(text)
    for _ in range(_MAX_LINKS):
        dest = _step(at, text, option, streams, inputs)
        if isinstance(dest, Destination):
            return dest
        at = dest
    raise _refuse(option, text, f"more than {_MAX_LINKS} symbolic links to follow (a loop?)")


def _step(at: str, given: str, option: str, streams: bool, inputs: tuple) -> Destination | str:
    """One link of the chain: the Destination `at` is, or the next path to look at (a symlink's target)."""
    fd = _own_fd(at)
    if fd is not None:
        return _descriptor(fd, at, given, option, streams)
    if _is_fd_path(at):  # another process's descriptor: a magic link, opened as it is (as `echo > PATH` does)
        if not streams:
            raise _refuse(option, given, f"names a file descriptor ({at}), not a regular file: a recording needs "
                                         f"a regular file")
        return Destination("stream", given, Path(at))
    try:
        info = os.lstat(at)
    except FileNotFoundError:
        return _new_file(at, given, option)
    except OSError as exc:
        raise _refuse(option, given, f"cannot be looked up ({exc.strerror or exc})") from None
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(at)
        parent = os.path.realpath(os.path.dirname(at))
        return os.path.normpath(os.path.join(parent, target))
    if stat.S_ISREG(info.st_mode):
        _not_an_input(at, given, option, inputs)
        return Destination("file", given, Path(at))
    return _special(info.st_mode, at, given, option, streams)


def _special(mode: int, at: str, given: str, option: str, streams: bool) -> Destination:
    """What exists at `at` and is neither a link nor a regular file: a stream (character device, FIFO) or refused."""
    if stat.S_ISDIR(mode):
        raise _refuse(option, given, "is a directory, expected a file path")
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        if not streams:
            kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device"
            raise _refuse(option, given, f"is {kind}, not a regular file: a recording needs a regular file")
        return Destination("stream", given, Path(at))
    kind = "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    raise _refuse(option, given, f"is {kind}: refused (give a file path)")


def _descriptor(fd: int, at: str, given: str, option: str, streams: bool) -> Destination:
    """This process's own descriptor `fd`, named by a path: stdout and stderr by name, others as streams."""
    try:
        info = os.fstat(fd)
    except OSError:
        raise _refuse(option, given, f"names file descriptor {fd}, which is not open") from None
    if not streams:
        raise _refuse(option, given, f"names file descriptor {fd} ({at}), not a regular file: a recording needs "
                                     f"a regular file")
    if stat.S_ISDIR(info.st_mode):
        raise _refuse(option, given, f"names file descriptor {fd}, a directory")
    if fd in (1, 2):
        return Destination("stdout" if fd == 1 else "stderr", given, fd=fd)
    if fd == 0:
        raise _refuse(option, given, "names standard input")
    return Destination("stream", given, fd=fd)


def _new_file(at: str, given: str, option: str) -> Destination:
    """A name that does not exist: written there when its folder exists (a dangling link's target included)."""
    folder = os.path.dirname(at)
    if not os.path.isdir(folder):
        raise _refuse(option, given, f"folder '{folder}' does not exist")
    return Destination("file", given, Path(at))


def _not_an_input(at: str, given: str, option: str, inputs: tuple) -> None:
    for other in inputs:
        with contextlib.suppress(OSError):
            if os.path.samefile(at, other):
                raise _refuse(option, given, f"would overwrite the input recording '{os.fspath(other)}': choose "
                                             f"another file")


def resolve_folder(given: str | os.PathLike, option: str) -> Path:
    """A folder oneiter writes files into (created when missing): an existing directory (through symlinks), or a
    name whose nearest existing ancestor is a directory; anything else that exists there is refused."""
    text = os.fspath(given)
    real = os.path.realpath(text)
    if os.path.isdir(real):
        return Path(text)
    if os.path.lexists(text) or os.path.lexists(real):
        what = "a dangling symbolic link" if os.path.islink(text) and not os.path.exists(real) else \
            "not a directory"
        raise _refuse(option, text, f"exists and is {what}; give a folder")
    ancestor = os.path.dirname(real)
    while ancestor and not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if ancestor and not os.path.isdir(ancestor):
        raise _refuse(option, text, f"'{ancestor}' is not a directory")
    return Path(text)


def file_in(folder: str | os.PathLike, name: str, option: str = "") -> Path:
    """`folder/name`, a file oneiter writes in its own output folder: refused when that name is already something
    other than a regular file (a symlink, a device, a FIFO, a folder), which is never followed or replaced."""
    path = Path(folder) / name
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(option, str(path), "exists and is not a regular file (a symlink, device, FIFO or "
                                             "folder): remove it or choose another folder")
    return path


# -- writing --------------------------------------------------------------------------------------------------------
def _mode_for(path: Path) -> int:
    """The permissions a plain `open(path, "w")` would give: the existing file's, else 0o666 minus the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_text(path: str | os.PathLike, *, encoding: str = "utf-8", errors: str = "strict",
                newline: str | None = None) -> Iterator[IO[str]]:
    """`with atomic_text(path) as fh: ...`: the regular file `path` appears (or is replaced) only once all was
    written; an exception, a full disk or a file-size limit leaves the previous file and no temporary one."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding=encoding, errors=errors, newline=newline) as fh:
        yield fh


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_path(path) as tmp: write(tmp)` (for writers that need a path, as h5py does): `tmp` is a new file
    beside `path`, synced and renamed over it once the block ends; an exception leaves the previous file and no
    temporary one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def open_text(dest: Destination, *, encoding: str = "utf-8", errors: str = "strict",
              newline: str | None = None) -> Iterator[IO[str]]:
    """A text file object for a resolved destination: atomic for a file; for stdout/stderr the text is written
    through `sys.stdout`/`sys.stderr` once complete; a stream is opened as it is (never created, truncated or
    renamed: a FIFO waits for its reader, as `echo > fifo` does) and written directly."""
    if dest.kind == "file":
        assert dest.path is not None  # a file destination always has its path
        with atomic_text(dest.path, encoding=encoding, errors=errors, newline=newline) as fh:
            yield fh
        return
    buffer = io.StringIO(newline=newline)
    yield buffer
    text = buffer.getvalue()
    if dest.kind in ("stdout", "stderr"):
        stream = sys.stdout if dest.kind == "stdout" else sys.stderr
        stream.flush()
        stream.write(text.encode(encoding, errors).decode(encoding))
        stream.flush()
        return
    data = text.encode(encoding, errors)
    if dest.fd is not None:
        _write_all(dest.fd, data)
        return
    flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    assert dest.path is not None  # a stream without a descriptor is named by its path
    fd = os.open(dest.path, flags)  # no O_CREAT, no O_TRUNC: the device or pipe as it is
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_text(dest: Destination, text: str, *, encoding: str = "utf-8") -> None:
    with open_text(dest, encoding=encoding) as fh:
        fh.write(text)


def destination(target: str | os.PathLike | Destination, option: str, **kwargs) -> Destination:
    """`target` resolved (`resolve`), or as it is when it already is a Destination: what API writers take."""
    return target if isinstance(target, Destination) else resolve(target, option, **kwargs)


def check_distinct(dests: list[tuple[str, Destination]]) -> None:
    """Two outputs of one command never write to the same file, nor both to stdout."""
    seen: dict[object, str] = {}
    for option, dest in dests:
        key: object
        if dest.kind in ("stdout", "stderr"):
            key = dest.kind
        elif dest.fd is not None:
            key = dest.fd
        else:
            assert dest.path is not None  # a file, or a stream named by its path
            key = os.path.realpath(dest.path)
        if key in seen:
            where = "stdout" if key == "stdout" else "stderr" if key == "stderr" else f"'{dest.given}'"
            raise OutputError(f"{seen[key]} and {option} both write to {where}: give them different destinations")
        seen[key] = option
