"""Where captured tensors go: `TensorSink` copies each tensor the hooks (`hooks.py`) and the recording session hand
it to the background writer (`format/writer.py`), once: a tensor seen before (same object, same version) is stored
as a hard link. `host_copy` is the detached CPU copy a recording keeps while the original changes or is freed.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

from oneiter.format.schema import check_name, group_path, shard_attrs
from oneiter.format.stats import tensor_stats
from oneiter.runtime.sharding import placement_of, shard_of

__all__ = ["TensorSink", "host_copy"]


def host_copy(tensor):
    """A detached, contiguous copy on the CPU: safe to keep while the original changes or is freed."""
    import torch

    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.to(device="cpu", memory_format=torch.contiguous_format, copy=True)


class TensorSink:
    """Copies tensors to the writer, storing a tensor seen before (same object, same version) as a hard link.

    `keep` (a dict), when given, also receives every host copy by path: `record --against cpu` reruns each call
    from the target's own values after backward.
    """

    def __init__(self, writer, on_capture: Callable[[int], None] | None = None, keep: dict | None = None,
                 stats_groups: Callable[[str], bool] | None = None):
        self.writer = writer
        self.stats_groups = stats_groups  # group -> True: statistics and a checksum only (`--level stats`)
        self.num_tensors = 0
        self.num_bytes = 0  # bytes of tensor data queued (links excluded)
        self.keep = keep
        self._seen: dict[int, tuple[Any, int, str]] = {}
        self._lock = threading.Lock()
        self._on_capture = on_capture

    def put(self, group: str, name: str, tensor, attrs: dict | None = None, *, dedup: bool = True) -> None:
        """Queue `tensor` as `group/name`. `dedup=False` for parameters and buffers: a kernel may update a buffer
        in place without bumping its version counter (BatchNorm's running stats), so version equality is only
        trusted for activations and gradients.

        A DTensor (FSDP2) is stored as this rank's shard, with its placement (`schema.shard_attrs`).
        The copy and the statistics run outside the iteration's dispatch modes (random-op recording, op
        fallback): they are not the model's ops, and each of their ops would otherwise pass through a Python
        `__torch_dispatch__` (0.1-0.3 ms more per tensor; 0.06 s of a resnet18 stats-level record)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.is_sparse or tensor.is_quantized:
            return
        placement = placement_of(tensor)
        if placement is not None:  # a sharded (FSDP2) parameter or gradient: this rank's shard, and where it sits
            attrs = {**(attrs or {}), **(shard_attrs(placement) or {})}
        tensor = shard_of(tensor)  # a DTensor's shard; a collective's result under way, waited for
        if torch._C._len_torch_dispatch_stack():
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                self._put(group, name, tensor, attrs, dedup)
        else:
            self._put(group, name, tensor, attrs, dedup)

    def _put(self, group: str, name: str, tensor, attrs: dict | None, dedup: bool) -> None:
        check_name(name, f"'{group}' entry")
        path = group_path(group, name)
        with self._lock:
            hit = self._seen.get(id(tensor))
            if dedup and hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
                self.writer.link(group, name, hit[2])
                if self.keep is not None:
                    self.keep[path] = self.keep.get(hit[2])
            else:
                key = id(tensor)
                ref = weakref.ref(tensor, functools.partial(_forget, self._seen, key))
                self._seen[key] = (ref, tensor._version, path)
                if self.stats_groups is not None and self.stats_groups(group):
                    dtype_name = str(tensor.dtype).removeprefix("torch.")
                    stats = tensor_stats(tensor)
                    self.writer.stats(group, name, stats, dtype_name, tuple(tensor.shape), attrs)
                    self.num_bytes += stats.values.nbytes
                elif self.keep is None:  # a ring slot, reused once written
                    self.writer.copy(group, name, tensor, attrs)
                    self.num_bytes += tensor.numel() * tensor.element_size()
                else:  # --against cpu reruns calls from these copies after backward: copies of their own
                    copy = host_copy(tensor)
                    self.writer.tensor(group, name, copy, attrs)
                    self.keep[path] = copy
                    self.num_bytes += copy.numel() * copy.element_size()
            self.num_tensors += 1
        if self._on_capture is not None:
            self._on_capture(self.num_tensors)


def _forget(seen: dict, key: int, _ref) -> None:
    """A written tensor was freed: its id may be reused, so it no longer links to the entry written for it."""
    seen.pop(key, None)
