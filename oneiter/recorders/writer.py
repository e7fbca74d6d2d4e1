"""The background writer: captured tensors go into a bounded queue and one thread writes them to HDF5.

The training thread only copies a tensor off its device (a memcpy on CPU) and hands it over; conversion and
HDF5 writes happen here. The queue is bounded by *bytes in flight*, so host memory stays bounded however large
the model is: when the budget is used up, `submit` waits until the writer has caught up.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

from ..fileformat import FileWriter, tensor_to_numpy

__all__ = ["BackgroundWriter", "DEFAULT_QUEUE_BYTES"]

DEFAULT_QUEUE_BYTES = 512 << 20
_STOP = object()


class BackgroundWriter:
    """Owns a `FileWriter` on its own thread. Errors raised there resurface in the caller on the next call."""

    def __init__(self, path: Path, meta: dict[str, Any], max_bytes: int = DEFAULT_QUEUE_BYTES):
        self._file = FileWriter(path, meta)
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._max_bytes = max_bytes
        self._error: BaseException | None = None
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
        self._queue.put(("tensor", group, name, tensor, attrs, nbytes))

    def link(self, group: str, name: str, target: str) -> None:
        self._raise_pending()
        self._queue.put(("link", group, name, target))

    def attrs(self, path: str, attrs: dict[str, Any]) -> None:
        self._raise_pending()
        self._queue.put(("attrs", path, attrs))

    def local_table(self, rows: list, unprobed: list, attrs: dict[str, Any]) -> None:
        self._raise_pending()
        self._queue.put(("local", rows, unprobed, attrs))

    def close(self, final_attrs: dict[str, Any]) -> tuple[int, int]:
        """Drain the queue, mark the file complete, close it. Returns (datasets incl. links, tensor bytes)."""
        self._queue.put(("finish", final_attrs))
        self._queue.put(_STOP)
        self._thread.join()
        self._raise_pending()
        return self._file.num_datasets, self._file.num_bytes

    def abort(self) -> None:
        """Stop without marking the file complete (the caller deletes the temporary file)."""
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
        self._file.abort()

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
                self._handle(item)
            except BaseException as exc:  # resurfaces in the producer; keep draining so nobody blocks forever
                self._error = exc
            finally:
                self._release(item)

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "tensor":
            _, group, name, tensor, attrs, _ = item
            array, dtype_name = tensor_to_numpy(tensor)
            self._file.write(group, name, array, dtype_name, attrs)
        elif kind == "link":
            self._file.link(*item[1:])
        elif kind == "attrs":
            self._file.set_attrs(*item[1:])
        elif kind == "local":
            self._file.local_table(*item[1:])
        elif kind == "finish":
            self._file.finish(item[1])

    def _release(self, item: Any) -> None:
        if isinstance(item, tuple) and item[0] == "tensor":
            with self._cond:
                self._in_flight -= item[-1]
                self._cond.notify_all()
