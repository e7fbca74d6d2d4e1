"""A model that uses low-precision dtypes by explicit casts in its own code, outside any recipe: a Linear computed in
float16 (its input, weight and bias cast with `.half()`, the product cast back) and an FP8 round trip with a per-tensor
scale (`x.to(torch.float8_e4m3fn)`), then a float32 Linear. Faults: faultkit's (`ONEITER_TEST_FAULT`), e.g.
`instance:down` or `instance:q`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, patch_functions


class HalfLinear(nn.Linear):
    """A Linear computed in float16 by explicit casts."""

    def forward(self, x):
        return F.linear(x.half(), self.weight.half(), self.bias.half()).to(x.dtype)


class Float8RoundTrip(nn.Module):
    """x scaled to float8's range, cast to float8_e4m3fn and back, unscaled."""

    def forward(self, x):
        scale = 448.0 / x.abs().amax().clamp(min=1e-12)
        return (x * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale


class CastNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = HalfLinear(64, 128)
        self.q = Float8RoundTrip()
        self.down = nn.Linear(128, 16)

    def forward(self, x):
        return self.down(self.q(torch.relu(self.up(x))))


def build(batch_size):
    patch_functions()
    model = CastNet()
    x, y = torch.randn(batch_size, 64), torch.randint(0, 16, (batch_size,))
    return apply_fault(model), (x,), lambda out: F.cross_entropy(out.float(), y.to(out.device))
