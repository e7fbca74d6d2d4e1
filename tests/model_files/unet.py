"""A tiny U-Net: two downsamplings, two bilinear upsamplings, skip connections concatenated in the root's forward.

The root's own code holds `F.max_pool2d`, `F.interpolate` and `torch.cat` (the skips), so a fault there belongs
to no submodule. MSE loss against a random target image. Kwargs: `image_size` (16, a multiple of 4), `width` (8).

Fault targets (env ONEITER_TEST_FAULT, see faultkit), where they live:
- `root`                                         the root's own code (the first upsampling line)
- `function:interpolate`, `function_bwd:interpolate`   the root's own code (`function:max_pool2d` too, though
  the next BatchNorm absorbs a uniform scale: the loss barely moves)
- `function:relu`                                `inc` (DoubleConv's own code)
- `class:DoubleConv`                             `inc`; `instance:up1`, `instance:down2.conv2`, `instance:outc`
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, fault_scale, patch_functions, undo_faults  # noqa: F401


class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class UNet(nn.Module):
    def __init__(self, channels=3, width=8):
        super().__init__()
        self.inc = DoubleConv(channels, width)
        self.down1 = DoubleConv(width, 2 * width)
        self.down2 = DoubleConv(2 * width, 4 * width)
        self.up1 = DoubleConv(4 * width + 2 * width, 2 * width)
        self.up2 = DoubleConv(2 * width + width, width)
        self.outc = nn.Conv2d(width, channels, 1)
        self.fault = fault_scale("root")  # `root`: 1 + REL, else exactly 1.0 (the multiply is skipped)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(F.max_pool2d(x1, 2))
        x3 = self.down2(F.max_pool2d(x2, 2))
        u = F.interpolate(x3, scale_factor=2, mode="bilinear", align_corners=False)
        if self.fault != 1.0:
            u = u * self.fault
        u = self.up1(torch.cat([u, x2], dim=1))
        u = F.interpolate(u, scale_factor=2, mode="bilinear", align_corners=False)
        u = self.up2(torch.cat([u, x1], dim=1))
        return self.outc(u)


def build(batch_size, image_size=16, width=8):
    patch_functions()
    model = UNet(width=width)
    x = torch.randn(batch_size, 3, image_size, image_size)
    target = torch.randn(batch_size, 3, image_size, image_size)
    return apply_fault(model), (x,), lambda out: F.mse_loss(out.float(), target.to(out.device))
