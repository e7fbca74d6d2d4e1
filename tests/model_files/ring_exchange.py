"""A context-parallel-style model whose layers exchange activations with the other ranks *inside their own forward*
(as ring attention passes key/value blocks around the ring), for `torchrun ... -m oneiter record --data-parallel
none`: pure torch, no oneiter.

`Exchange.forward(x)` posts `isend(x, next)` and `irecv(prev)` and returns x + the received block; its backward
does the same with the gradient in the opposite direction (what the receiving rank's backward owes the sender), so
every rank's forward and backward communicate point to point from within `blocks.<i>.mix`. Every rank builds the
same weights (a fixed seed) and its own sequence shard (seed + rank). `p2p_fault=<rank>` installs
`faulty_p2p` (that rank's first floating-point send is 0.1 % off) before anything communicates. One process: no
exchange.
"""

import faulty_p2p
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _ring() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _exchange(tensor: torch.Tensor, to: int, frm: int) -> torch.Tensor:
    got = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), to),
                                    dist.P2POp(dist.irecv, got, frm)])
    for work in works:
        work.wait()
    return got


class _RingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        rank, world = _ring()
        return _exchange(x, (rank + 1) % world, (rank - 1) % world)

    @staticmethod
    def backward(ctx, grad):
        rank, world = _ring()
        return _exchange(grad, (rank - 1) % world, (rank + 1) % world)


class Exchange(nn.Module):
    def forward(self, x):
        if _ring()[1] == 1:
            return x + x
        return x + _RingStep.apply(x)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.mix = Exchange()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.mix(self.up(x))))


class RingMLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(batch_size, width=16, depth=2, p2p_fault=-1):
    if p2p_fault >= 0:
        faulty_p2p.install(rank=p2p_fault, nth=0)
    torch.manual_seed(1234)
    model = RingMLP(width, depth)
    gen = torch.Generator().manual_seed(100 + _ring()[0])
    x = torch.randn(batch_size, width, generator=gen)
    y = torch.randint(0, 4, (batch_size,), generator=gen)
    return model, (x,), lambda out: F.cross_entropy(out, y.to(out.device))
