"""The background writer's host ring: slots handed out in FIFO order, reused, never overlapping while in use."""

from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest
import torch

from oneiter.format.writer import BackgroundWriter, HostRing


def test_the_ring_wraps_and_never_hands_out_memory_in_use():
    ring = HostRing(256)
    a, b, c = ring.take(100), ring.take(60), ring.take(40)  # 128 + 64 + 64 bytes after alignment
    assert (a, b, c) == ((0, 128), (128, 64), (192, 64))
    assert ring.take(300) is None  # larger than the ring: never fits
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.take(100)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []  # full: waits for the writer
    ring.give_back(a)
    waiter.join(5)
    assert got == [(0, 128)]  # wrapped into the freed head
    ring.give_back(b)
    ring.give_back(c)
    ring.give_back(got[0])
    assert ring.take(256) == (0, 256)  # empty again: the whole ring


@pytest.mark.parametrize("direct", [False, True])
def test_tensors_are_written_bitwise_through_the_ring_or_directly(tmp_path, direct):
    """Through the ring (an accelerator's path; forced here on CPU tensors) or written by the calling thread at
    their dataset's offset (CPU tensors, the default), every tensor reads back bit for bit with plain h5py; the
    direct path never allocates the ring."""
    writer = BackgroundWriter(tmp_path / "w.h5", {"model": "x"}, max_bytes=4096, direct=direct)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(100 + i, generator=gen) for i in range(50)}  # ~20 KB through a 4 KB ring
    tensors["big"] = torch.randn(5000, generator=gen)  # larger than the ring: its own copy
    tensors["strided"] = torch.randn(40, 30, generator=gen).t()  # not contiguous: copied contiguous
    tensors["bf16"] = torch.randn(64, generator=gen).to(torch.bfloat16)
    tensors["scalar"], tensors["empty"] = torch.tensor(2.5), torch.zeros(0, 3)  # no offset: written by HDF5
    tensors["view"] = torch.randn(64, generator=gen)[7:]  # starts inside its storage
    for name, tensor in tensors.items():
        writer.copy("g", name, tensor)
    writer.close({"complete_check": 1})
    assert (writer.ring._buffer is None) == direct
    with h5py.File(tmp_path / "w.h5") as f:
        for name, tensor in tensors.items():
            stored = f["g"][name][()]
            mine = tensor.contiguous().view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
            assert stored.tobytes() == np.ascontiguousarray(mine).tobytes(), name
