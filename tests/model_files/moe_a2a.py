"""A 2-expert mixture-of-experts layer with expert parallelism, written by hand as people do (pure torch, no oneiter):
each rank of an expert-parallel group of 2 holds one expert; a top-1 router picks an expert per token, the tokens
are sorted by expert and *dispatched* to its rank with `all_to_all_single` (the counts first, as integers), the
expert runs, and the results are *combined* back with the reverse all-to-all (an autograd Function whose backward
is the opposite all-to-all), then put back in order and scaled by the router's gate. The experts' parameters carry
Megatron-LM's mark of an expert's own weight (`allreduce = False`).

With 4 ranks there are two expert-parallel groups, {0, 1} and {2, 3} (`dist.new_group`), each with both experts.
Every rank routes its own tokens (its own batch); the router and the experts are built from fixed generators (the
same expert on every group). `collective_fault=offset` installs a wrong all-to-all (`faulty_collectives.py`). One
process builds the layer with both experts local (no communication).
"""

import faulty_collectives
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EXPERTS = 2


def _group():
    """(this rank's index in its expert-parallel group, the group) or (0, None) in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, None
    world = dist.get_world_size()
    if world % EXPERTS:
        raise ValueError(f"moe_a2a needs a multiple of {EXPERTS} ranks, got {world}")
    mine = None
    for first in range(0, world, EXPERTS):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + EXPERTS)))
        if first <= dist.get_rank() < first + EXPERTS:
            mine = group
    return dist.get_rank() % EXPERTS, mine


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class Expert(nn.Module):
    def __init__(self, width: int, gen: torch.Generator):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        for layer in (self.up, self.down):
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / layer.in_features ** 0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, width: int, gen: torch.Generator):
        super().__init__()
        self.index, self.group = _group()
        self.router = nn.Linear(width, EXPERTS, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(EXPERTS, width, generator=gen))
        experts = [Expert(width, gen) for _ in range(EXPERTS)]  # every rank draws both: the same weights everywhere
        self.experts = nn.ModuleList(experts if self.group is None else [experts[self.index]])
        if self.group is not None:
            for p in self.experts.parameters():
                p.allreduce = False  # Megatron-LM's mark: an expert's own weight, never averaged over ranks

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        gate, choice = probs.max(dim=-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=EXPERTS)
        if self.group is None:
            outs = [self.experts[e](x[order][choice[order] == e]) for e in range(EXPERTS)]
            combined = torch.cat(outs)
        else:
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.group)  # how many tokens each peer sends this expert
            send, recv = counts.tolist(), got.tolist()
            dispatched = _AllToAll.apply(x[order], send, recv, self.group)
            combined = _AllToAll.apply(self.experts[0](dispatched), recv, send, self.group)
        out = torch.empty_like(combined).index_copy(0, order, combined)
        return x + gate.unsqueeze(-1) * out


class Net(nn.Module):
    def __init__(self, width: int = 16, gen: torch.Generator | None = None):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.moe = MoE(width, gen)
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def build(batch_size, width=16, collective_fault="", fault_rank=1, fault_min_numel=0):
    if collective_fault:
        faulty_collectives.install(collective_fault, rank=fault_rank, min_numel=fault_min_numel)
    else:
        faulty_collectives.uninstall()
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)  # inp and out: the same on every rank
    model = Net(width, gen)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(batch_size, 8, generator=data)
    y = torch.randint(0, 4, (batch_size,), generator=data)
    return model, (x,), lambda out: F.cross_entropy(out, y.to(out.device))
