"""Reading a recorded tensor by mapping its bytes instead of copying them through the HDF5 library.

Where this sits: `IterationFile.raw` (layout.py) asks `MappedReader.array(stored)` first — `stored` is what the
validation walk saw of the dataset (`validate.Stored`) — and falls back to h5py's own read when it answers None. A
replay reads the whole reference (resnet18 batch 8: 731 MB in ~1,000 reads); through h5py every read allocates fresh
memory and copies the page cache into it, which on this VM ran at ~1 GB/s. A private mapping of the dataset's bytes
costs one `mmap` call: the pages are the page cache's own (already there after the reference was written or read),
and nothing is copied until someone writes to the array (copy-on-write: the file is never changed).

Only plain data qualifies: a contiguous dataset with no filters, allocated (the walk gives only those an `offset`),
of a native-order numeric dtype, at least 64 KB, lying wholly inside the file (a truncated file is a `FormatError`,
never a SIGBUS). Each read gets its own mapping of just its bytes, unmapped when the last array or tensor viewing it
is freed, so memory held is what the caller keeps, as with a copy. Mappings do not hold file descriptors (one is
kept per file, not per read).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np

from oneiter.errors import FormatError

__all__ = ["MappedReader"]

_PAGE = mmap.ALLOCATIONGRANULARITY
_MIN_BYTES = 64 << 10  # smaller datasets: h5py's read is as cheap as a mapping


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # no C library with mmap (not POSIX): h5py reads everything
        return None


_LIBC = _libc() if os.name == "posix" else None
_FAILED = ctypes.c_void_p(-1).value


class MappedReader:
    """Maps contiguous datasets of one open HDF5 file (see the module docstring)."""

    def __init__(self, path):
        self._fd = -1
        if _LIBC is None:
            return
        try:
            self._fd = os.open(path, os.O_RDONLY)
            self._size = os.fstat(self._fd).st_size
        except OSError:
            self._fd = -1

    def close(self) -> None:
        """Close the file descriptor; arrays already handed out stay valid (their mappings outlive it)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def array(self, stored, where: str):
        """A dataset's data as a writable (copy-on-write) numpy array over a mapping, or None when it does not
        qualify (then read it through h5py). `stored`: what the validation walk saw of it (`validate.Stored`:
        `offset` is set only for contiguous, unfiltered, allocated data)."""
        dtype, offset = stored.dtype, stored.offset
        if self._fd < 0 or _LIBC is None or offset is None or dtype.kind not in "biufc" or not dtype.isnative:
            return None
        count = int(np.prod(stored.shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if nbytes < _MIN_BYTES:
            return None
        if offset + nbytes > self._size:
            raise FormatError(f"{where}: its data ends at byte {offset + nbytes}, past the end of the file "
                              f"({self._size} bytes); the file is truncated")
        start = offset - offset % _PAGE
        length = offset + nbytes - start
        addr = _LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, self._fd, start)
        if addr is None or addr == _FAILED:
            return None
        buffer = (ctypes.c_char * length).from_address(addr)
        weakref.finalize(buffer, _LIBC.munmap, addr, length)
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset - start).reshape(stored.shape)
