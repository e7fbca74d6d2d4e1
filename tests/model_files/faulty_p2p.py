"""A stand-in vendor point-to-point library that corrupts one transfer, registered the way a device plugin registers
its communication kernels: a `torch.library` kernel over torch's `c10d::send` for one backend (here the CPU, which
gloo serves), installed by the training script before anything communicates. Pure torch: it never imports or
consults oneiter.

`install(rank=0, nth=0, rel=1e-3)`: rank `rank`'s `nth` send of floating-point data (counted from 0 over those it
posts after the install) leaves with every element (1 + rel) times what the caller handed it; every other send is
gloo's own. The
kernel sends through the group's gloo `Backend` (which it does not replace). `uninstall()` puts torch's kernel back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_LIB: list = []


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()


def install(rank: int = 0, nth: int = 0, rel: float = 1e-3) -> None:
    """Register the corrupting send (module docstring); a second call replaces the first."""
    uninstall()
    lib = torch.library.Library("c10d", "IMPL")
    _LIB.append(lib)
    fault = _Send(rank, nth, rel)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        lib.impl("send", fault.send, "CPU")


class _Send:
    def __init__(self, rank: int, nth: int, rel: float):
        self.rank, self.nth, self.rel, self.count = rank, nth, rel, 0
        self.kept: list = []  # what is on the wire stays alive until the process ends

    def send(self, tensors, process_group, dst, tag):
        backend = dist.ProcessGroup.unbox(process_group)._get_backend(torch.device("cpu"))
        if dist.get_rank() == self.rank and all(t.is_floating_point() for t in tensors):
            if self.count == self.nth:
                tensors = [t * (1.0 + self.rel) for t in tensors]
                self.kept.append(tensors)
            self.count += 1
        return backend.send(list(tensors), dst, tag).boxed()
