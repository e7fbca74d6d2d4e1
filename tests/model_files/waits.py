"""A user model whose forward announces it is running and then waits (up to a minute): a record of it is inside
the iteration, with its output file open, for as long as a test needs (the SIGTERM test signals it there)."""

import os
import time

import torch
import torch.nn as nn

READY_ENV = "ONEITER_TEST_READY"  # a path the forward creates once it runs


class Waits(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        ready = os.environ.get(READY_ENV)
        if ready:
            open(ready, "w").close()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return self.out(h)


def build(batch_size):
    model = Waits()
    x = torch.randn(batch_size, 8)
    y = torch.randint(0, 2, (batch_size,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y.to(out.device))
