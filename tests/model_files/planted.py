"""A small residual MLP with room for faults of different size and reach (`record --impact`'s ground truth).

`first` feeds everything; `layers.0..7` are residual blocks (`h + tanh(layer(h))`); `branch` reads the first
hidden state and joins the main path scaled by 1e-3, just before `head`. Faults (`faultkit`, env
ONEITER_TEST_FAULT, several separated by `;`): `instance_below64:branch:0.05` (5 % in a branch whose output barely
reaches the loss), `instance_below64:first:0.02` (2 % in the first layer), `instance_below64:layers.4:0.01` (1 %
halfway down). `below64`: the module's kernel is wrong in the run's precisions and right in float64, as a device
kernel with a broken low-precision path.
"""

import torch
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests recording in one process)
from torch import nn

BRANCH_SCALE = 1e-3


class Planted(nn.Module):
    def __init__(self, width: int = 32, depth: int = 8, classes: int = 10):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.branch = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        side = self.branch(h) * BRANCH_SCALE
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h + side)


def build(batch_size, width=32, depth=8, classes=10, x_scale=0.1):
    patch_functions()
    model = Planted(width, depth, classes)
    x = torch.randn(batch_size, width) * x_scale
    labels = torch.randint(0, classes, (batch_size,))

    def loss_fn(out):
        return nn.functional.cross_entropy(out.float(), labels.to(out.device))

    return apply_fault(model), (x,), loss_fn
