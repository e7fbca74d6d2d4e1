"""One leaf module per common op, all with float64 kernels: where the Monte Carlo noise estimate is measured
against the float64-based one (bench/monte_carlo_noise.py, tests/record/local/test_monte_carlo.py).

conv (3x3, 4 -> 8 channels on 8x8) -> flatten (the root's own code) -> lin1 (512 -> 64) -> norm (LayerNorm) ->
softmax (nn.Softmax) -> act (SiLU) -> lin2 (64 -> 16). Kwargs: `width` (64).
"""

import torch
import torch.nn as nn
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401


class Ops(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.lin1 = nn.Linear(8 * 8 * 8, width)
        self.norm = nn.LayerNorm(width)
        self.softmax = nn.Softmax(dim=-1)
        self.act = nn.SiLU()
        self.lin2 = nn.Linear(width, 16)

    def forward(self, x):
        h = torch.flatten(self.conv(x), 1)
        return self.lin2(self.act(self.softmax(self.norm(self.lin1(h))) * 64.0))


def build(batch_size, width=64):
    patch_functions()
    model = Ops(width)
    x = torch.randn(batch_size, 4, 8, 8)
    target = torch.randn(batch_size, 16)

    def loss_fn(out):
        return torch.nn.functional.mse_loss(out.float(), target.to(out.device))

    return apply_fault(model), (x,), loss_fn
