"""The background writer: captured tensors reach the HDF5 file with one copy each, off the training thread's back
where that pays.

CPU tensors (`direct`, the default) are written by the calling thread straight from their memory into the file:
the writer creates the dataset with its storage allocated at once (`FileWriter.reserve`) and the bytes go there
with `os.pwrite`, the GIL released — one copy, into the page cache, and no host buffer at all. On a CPU the
training and the copy share the same cores either way, so a second copy through a buffer only costs more
(resnet18 batch 8, 6 interleaved pairs: 1.17-1.40 s, median 1.23, instead of 1.28-1.38 s, median 1.32; peak
memory over the plain iteration +226 MB instead of +379 MB in `bench/bench_record.py`).

Tensors on an accelerator are copied off the device into a slot of a host ring buffer (`HostRing`, one `copy_`)
and handed to a writer thread, so the device keeps computing while the file is written. The ring is reused slot
after slot — the writer frees slots in the order they were taken — so its pages are touched once, not once per
tensor, and host memory stays bounded however large the model is: when the ring is full, the producer waits until
the writer has caught up. A tensor larger than the ring gets its own host copy, bounded by the same byte budget.
Links, statistics rows and the tables go through the writer thread's queue; groups' attributes are merged in
memory and written when the file closes. The `FileWriter` is used under one lock by both threads.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oneiter.errors import OneIterError
from oneiter.format.file_writer import FileWriter
from oneiter.format.schema import tensor_to_numpy

if TYPE_CHECKING:
    import torch

__all__ = ["BackgroundWriter", "DEFAULT_QUEUE_BYTES"]

DEFAULT_QUEUE_BYTES = 512 << 20
_STOP = object()


def _write_error(exc: OSError, path: Path) -> OneIterError:
    """An OSError of the HDF5 library (its message spans lines) as one line with its cause."""
    import errno
    import os

    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return OneIterError(f"no space left to write the recording in '{Path(path).parent}' "
                            f"({os.strerror(code)}); nothing was written: free space or write it elsewhere")
    reason = os.strerror(code) if code else " ".join(str(exc).split())[:300]
    return OneIterError(f"writing the recording in '{Path(path).parent}' failed: {reason}")


class HostRing:
    """A ring of host memory handed out in FIFO order: `take(nbytes)` waits for room, `give_back` frees the oldest."""

    ALIGN = 64

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None  # allocated on first use
        self._taken: collections.deque = collections.deque()  # (start, size) in the order they were taken
        self._head = 0
        self._cond = threading.Condition()
        self.closed = False

    def take(self, nbytes: int):
        """(start, size) of a free slot of `nbytes`, waiting for the writer if needed; None if it can never fit."""
        import torch

        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if size > self.capacity:
            return None
        with self._cond:
            if self._buffer is None:
                self._buffer = torch.empty(self.capacity, dtype=torch.uint8)
            while True:
                start = self._fit(size)
                if start is not None or self.closed:
                    break
                self._cond.wait()
            if start is None:
                return None
            self._taken.append((start, size))
            self._head = start + size
            return start, size

    def _fit(self, size: int):
        if not self._taken:
            self._head = 0
            return 0
        tail = self._taken[0][0]
        if self._head > tail:  # used: [tail, head); free: [head, capacity) and [0, tail)
            if self.capacity - self._head >= size:
                return self._head
            return 0 if tail >= size else None
        return self._head if tail - self._head >= size else None  # wrapped: free is [head, tail)

    def view(self, slot, dtype, shape):
        """The slot as an empty tensor of `dtype` and `shape`."""
        import torch

        start, _size = slot
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert self._buffer is not None  # a slot was taken: `take` allocated it
        return self._buffer[start:start + nbytes].view(dtype).view(shape)

    def give_back(self, slot) -> None:
        with self._cond:
            if self._taken and self._taken[0] == slot:
                self._taken.popleft()
            else:  # not expected (the writer frees in order); stay correct anyway
                self._taken.remove(slot)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class BackgroundWriter:
    """Owns a `FileWriter` on its own thread. Errors raised there resurface in the caller on the next call."""

    def __init__(self, path: Path, meta: dict[str, Any], max_bytes: int = DEFAULT_QUEUE_BYTES, direct: bool = True):
        self._file = FileWriter(path, meta)
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._max_bytes = max_bytes
        self._error: BaseException | None = None
        self.ring = HostRing(max_bytes)
        self.direct = direct
        self._file_lock = threading.Lock()  # the FileWriter is used by this thread and by the writer thread
        self._attrs: dict[str, dict[str, Any]] = {}  # group path -> attributes, written by close()
        self._attrs_lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY) if direct else -1
        self.peak_in_flight = 0
        self._thread = threading.Thread(target=self._run, name="oneiter-writer", daemon=True)
        self._thread.start()

    # -- producer side (training thread, autograd threads) ----------------------------------------------------------
    def tensor(self, group: str, name: str, tensor, attrs: dict | None = None) -> None:
        """Queue a host copy of a tensor (the caller made the copy) for writing as `group/name`."""
        nbytes = tensor.element_size() * tensor.numel()
        with self._cond:
            self._raise_pending()
            while self._in_flight and self._in_flight + nbytes > self._max_bytes and self._error is None:
                self._cond.wait()
            self._in_flight += nbytes
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        self._queue.put(("tensor", group, name, tensor, attrs, nbytes, None))

    def copy(self, group: str, name: str, tensor, attrs: dict | None = None):
        """Write `tensor` (any device, any layout): a CPU tensor at once by this thread (`direct`), any other copied
        into a ring slot and queued. Returns the host data written (valid until written: keep nothing of it)."""
        self._raise_pending()
        source = tensor.detach()
        if source.is_conj():
            source = source.resolve_conj()
        if source.is_neg():
            source = source.resolve_neg()
        if self.direct and source.device.type == "cpu":
            return self._write_direct(group, name, source.contiguous(), attrs)
        slot = self.ring.take(source.numel() * source.element_size())
        if slot is None:  # larger than the ring: a copy of its own
            import torch

            copy = source.to(device="cpu", memory_format=torch.contiguous_format, copy=True)
            self.tensor(group, name, copy, attrs)
            return copy
        copy = self.ring.view(slot, source.dtype, source.shape)
        copy.copy_(source)
        self._queue.put(("tensor", group, name, copy, attrs, 0, slot))
        return copy

    def _write_direct(self, group: str, name: str, source, attrs: dict | None):
        """A contiguous CPU tensor written by this thread at the offset its dataset was given (module docstring)."""
        array, dtype_name = tensor_to_numpy(source)
        try:
            with self._file_lock:
                offset = self._file.reserve(group, name, array, dtype_name, attrs)
            if offset >= 0:
                view = array.reshape(-1).view(np.uint8).data  # a memoryview of its bytes
                while view:
                    written = os.pwrite(self._fd, view, offset)
                    view, offset = view[written:], offset + written
        except OSError as exc:  # a full disk, a file size limit: one line with the cause, as on the writer thread
            self._error = _write_error(exc, self._file.path)
            raise self._error from exc
        return source

    def stats(self, group: str, name: str, stats, dtype_name: str, shape: tuple, attrs: dict | None = None) -> None:
        """Queue a stats-level entry (`format.stats`): the tensor's statistics and checksum, no data."""
        self._raise_pending()
        self._queue.put(("stats", group, name, stats, dtype_name, shape, attrs))

    def link(self, group: str, name: str, target: str) -> None:
        self._raise_pending()
        self._queue.put(("link", group, name, target))

    def attrs(self, path: str, attrs: dict[str, Any]) -> None:
        """Set attributes of the group `path`. They are merged in memory and written once, by `close`: HDF5 takes
        ~0.5 ms per call group's attributes, and on the writer thread during the iteration that cost is paid
        twice, in GIL contention with the hooks (resnet18 stats-level record: 0.1 s of 0.8 s)."""
        self._raise_pending()
        with self._attrs_lock:
            self._attrs.setdefault(path, {}).update(attrs)

    def local_table(self, rows: list, unprobed: list, attrs: dict[str, Any]) -> None:
        self._raise_pending()
        self._queue.put(("local", rows, unprobed, attrs))

    def impact_table(self, rows: list, attrs: dict[str, Any]) -> None:
        self._raise_pending()
        self._queue.put(("impact", rows, attrs))

    def close(self, final_attrs: dict[str, Any]) -> tuple[int, int]:
        """Drain the queue, write the groups' attributes, mark the file complete, close it. Returns (datasets incl.
        links, tensor bytes)."""
        with self._attrs_lock:
            merged, self._attrs = self._attrs, {}
        for path, attrs in merged.items():
            self._queue.put(("attrs", path, attrs))
        self._queue.put(("finish", final_attrs))
        self._queue.put(_STOP)
        self._thread.join()
        self.ring.close()
        self._close_fd()
        self._raise_pending()
        return self._file.num_datasets, self._file.num_bytes

    def abort(self) -> None:
        """Stop without marking the file complete (the caller deletes the temporary file). After a write error
        the file is first emptied: closing flushes HDF5's metadata, which on a full disk fails inside the library
        (and has crashed it); with the data's blocks freed, that flush has room."""
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
        self.ring.close()
        self._close_fd()
        self._file.abort(empty_first=self._error is not None)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    # -- consumer side (writer thread) ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                self._release(item)
                continue
            try:
                with self._file_lock:
                    self._handle(item)
            except OSError as exc:  # a full disk, a file size limit: say so in one line, keep the cause
                self._error = _write_error(exc, self._file.path)
                self._error.__cause__ = exc
            except BaseException as exc:  # resurfaces in the producer; keep draining so nobody blocks forever
                self._error = exc
            finally:
                self._release(item)

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "tensor":
            _, group, name, tensor, attrs, _, _ = item
            array, dtype_name = tensor_to_numpy(tensor)
            self._file.write(group, name, array, dtype_name, attrs)
        elif kind == "stats":
            self._file.write_stats(*item[1:])
        elif kind == "link":
            self._file.link(*item[1:])
        elif kind == "attrs":
            self._file.set_attrs(*item[1:])
        elif kind == "local":
            self._file.local_table(*item[1:])
        elif kind == "impact":
            self._file.impact_table(*item[1:])
        elif kind == "finish":
            self._file.finish(item[1])

    def _release(self, item: Any) -> None:
        if isinstance(item, tuple) and item[0] == "tensor":
            if item[-1] is not None:
                self.ring.give_back(item[-1])
                return
            with self._cond:
                self._in_flight -= item[-2]
                self._cond.notify_all()
