"""A module that keeps a tensor of its forward as a plain attribute, as Hugging Face's RecurrentGemma RG-LRU keeps
its final recurrent state (`self.recurrent_states`, neither parameter nor buffer): `Scan` runs a gated linear
recurrence from `self.state` (zeros when None) and leaves its final state there, a tensor of the graph, for its next
call; `Block` sets it to None before calling it, as RecurrentGemma's recurrent block does without a cache. Nothing
here knows oneiter.

`build_twice`: the same scan called twice in one forward (`TwiceBlock`), the second call on the later half of the
sequence starting from the state the first left: the state is carried between two calls of one iteration, its
gradient reaching the first call through the attribute. Faults: `faultkit` (ONEITER_TEST_FAULT), e.g.
`instance:block.scan` (both calls' outputs scaled) or `instance_bwd:block.out`."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests)


class Scan(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gate_weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)  # its own parameters, as the RG-LRU's
        self.gate_bias = nn.Parameter(torch.zeros(dim))
        self.state = None

    def forward(self, x):
        a = torch.sigmoid(torch.addmm(self.gate_bias, x.reshape(-1, x.shape[-1]), self.gate_weight)).reshape(x.shape)
        h = torch.zeros_like(x[:, 0]) if self.state is None else self.state
        steps = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            steps.append(h)
        self.state = h
        return torch.stack(steps, 1)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.scan = Scan(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        self.scan.state = None
        return x + self.out(self.scan(self.inp(x)))


class TwiceBlock(Block):
    def forward(self, x):
        self.scan.state = None
        h = self.inp(x)
        half = x.shape[1] // 2
        first = self.scan(h[:, :half])
        second = self.scan(h[:, half:])  # starts from the state the first call left
        return x + self.out(torch.cat([first, second], 1))


class Net(nn.Module):
    def __init__(self, dim: int = 8, block=Block):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.block = block(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def build(batch_size):
    model = Net()
    x = torch.randn(batch_size, 6, 4)
    y = torch.randint(0, 3, (batch_size, 6))
    return model, (x,), lambda out: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1).to(out.device))


def build_twice(batch_size):
    patch_functions()
    model = Net(block=TwiceBlock)
    x = torch.randn(batch_size, 6, 4)
    y = torch.randint(0, 3, (batch_size, 6))
    return apply_fault(model), (x,), lambda out: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1).to(out.device))
