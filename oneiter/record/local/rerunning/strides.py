"""A rerun's tensors laid out as the live call's were (strides, storage offset): a kernel may depend on them.

Where this sits: `rerun.py` lays out each input, seed gradient and forced child's output it hands a kernel."""

from __future__ import annotations

import torch

from oneiter.format.schema import layout_from_attrs

__all__ = ["with_layout", "stored_layout"]


def with_layout(value, layout: tuple | None):
    """`value` with the live call's strides and storage offset (`structure.layout_of`), differentiably: a view into
    a fresh buffer laid out as the live tensor's storage was. None, or a layout that does not fit: `value` as it is.
    """
    if layout is None or value.layout != torch.strided or value.numel() == 0:
        return value
    stride, offset = layout
    size = tuple(value.shape)
    if len(stride) != len(size) or any(s < 0 for s in stride) or offset < 0:
        return value
    if tuple(value.stride()) == tuple(stride) and value.storage_offset() == offset:
        return value
    # where each element sits in the storage: offset + sum(i_k * stride_k); overlapping views (stride 0) write
    # one storage element several times with the same value
    index = torch.full((), offset, dtype=torch.long, device=value.device)
    for dim, (n, step) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[dim] = n
        index = index + torch.arange(n, device=value.device).mul_(step).reshape(shape)
    extent = int(index.max()) + 1
    base = value.new_zeros(extent).index_put((index.reshape(-1),), value.reshape(-1))
    return base.as_strided(size, tuple(stride), offset)


def stored_layout(source, path: str) -> tuple | None:
    """The live layout a source recorded with `path` (its `stride` and `storage_offset` attributes), or None:
    contiguous, or a source that keeps no attributes (this run's own copies, `probe.MemorySource`)."""
    attrs = getattr(source, "attrs", None)
    return layout_from_attrs(attrs(path)) if callable(attrs) else None
