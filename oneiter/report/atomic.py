"""Report files written whole or not at all: into a temporary file in the same folder, renamed over the target.

A full disk, a file-size limit or an exception while rendering leaves the previous file (if any) untouched and no
0-byte or half-written report behind: the temporary file is removed and the error goes on to the caller.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_output", "write_text_atomic"]


def _mode_for(path: Path) -> int:
    """The permissions a plain `open(path, "w")` would give: the existing file's, else 0o666 minus the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, encoding: str = "utf-8", errors: str = "strict",
                  newline: str | None = None) -> Iterator[IO[str]]:
    """`with atomic_output(path) as fh: fh.write(...)`: `path` appears (or is replaced) only once all was written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding, errors=errors, newline=newline) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> None:
    with atomic_output(path, encoding=encoding) as fh:
        fh.write(text)
