"""A small CNN whose own `forward` holds functional code, a shared block called twice and a keyword-called head.

What it exercises: functional ops in the root's forward (`F.relu`, a residual add, `F.avg_pool2d`,
`torch.flatten`, `F.layer_norm` with the root's own parameters), a block shared by two calls at two resolutions
(8x8, then 4x4: `shared@0`, `shared@1`), a head called with keyword arguments only, one of them a non-tensor and
one None (`self.head(x=h, scale=2.0, bias=None)`). Faults (`faultkit`, env ONEITER_TEST_FAULT), for example:
`root` (the avg-pool line of the root's forward: `(root)`), `instance:shared@4` (only the second call of the
shared block: `shared@1`), `instance:head` (the keyword-called module), `class:Block`,
`function:avg_pool2d` (the root's own code), `function_bwd:gelu` (`shared`, backward only).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, fault_scale, patch_functions, undo_faults  # noqa: F401


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Shared(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return F.gelu(self.conv(x))


class Head(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, *, x, scale, bias=None):
        out = self.fc(x) * scale
        return out if bias is None else out + bias


class Net(nn.Module):
    def __init__(self, channels=8, num_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.block = Block(channels)
        self.shared = Shared(channels)
        self.ln_weight = nn.Parameter(torch.ones(channels))
        self.ln_bias = nn.Parameter(torch.zeros(channels))
        self.head = Head(channels, num_classes)
        self.channels = channels
        self.fault = 1.0  # the builder sets 1 + REL for the `root` fault: exactly 1.0 changes no bit

    def forward(self, x):
        h = F.relu(self.bn(self.stem(x)))
        h = self.block(h) + h
        h = self.shared(h)
        h = F.avg_pool2d(h, 2) * self.fault
        h = self.shared(h)
        h = torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)
        h = F.layer_norm(h, (self.channels,), self.ln_weight, self.ln_bias)
        return self.head(x=h, scale=2.0, bias=None)


def build(batch_size, image_size=8, num_classes=10):
    patch_functions()
    model = Net(num_classes=num_classes)
    model.fault = fault_scale("root")
    x = torch.randn(batch_size, 3, image_size, image_size)
    y = torch.randint(0, num_classes, (batch_size,))
    return apply_fault(model), (x,), lambda out: F.cross_entropy(out, y.to(out.device))
