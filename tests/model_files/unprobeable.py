"""A model with a block that refuses to run twice in one iteration, so no local probe can rerun it.

`Once` keeps state in the module (a flag set by its first call and cleared by the model's forward pre-hook), the
kind of side effect a rerun cannot repeat. Its fault (`instance:once`, faultkit) therefore sits where no probe
sees it: the verdict must be `unattributed`, never MATCH.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401


class Once(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.used = False

    def forward(self, x):
        if self.used:
            raise RuntimeError("Once ran twice in one iteration")
        self.used = True
        return torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.once = Once(32)
        self.out = nn.Linear(32, 4)
        self.register_forward_pre_hook(lambda module, args: setattr(module.once, "used", False))

    def forward(self, x):
        return self.out(self.once(F.relu(self.inp(x))))


def build(batch_size):
    patch_functions()
    model = Net()
    x, y = torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
    return apply_fault(model), (x,), lambda out: F.cross_entropy(out, y.to(out.device))
