"""A user model whose shared block is called twice per forward (tied weights), written from the README contract."""

import torch
import torch.nn as nn


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.shared = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        h = self.shared(h)
        h = self.shared(h) + h  # second call of the same block
        return self.out(h)


def build(batch_size):
    model = Twice()
    x = torch.randn(batch_size, 16)
    y = torch.randint(0, 4, (batch_size,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y.to(out.device))
