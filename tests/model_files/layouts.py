"""Stock torch.nn models whose kernels' summation order depends on how their operands sit in memory, or whose
buffer update rounds to exactly its start: a clean replay of each must be a MATCH.

- `kind="convnext"`: ConvNeXt's block written with torch.nn (depthwise Conv2d, a channels-last permute, LayerNorm,
  two Linears and a layer scale, then a residual), twice, after a stem whose LayerNorm runs on a permuted view (as
  Hugging Face's ConvNeXt does): the blocks' activations, and the gradient block 0's output gets from block 1, are
  laid out channels_last, and the layer scale's gradient, a sum over batch and pixels, comes out in another order
  from a contiguous copy of that gradient.
- `kind="zero_mean"`: BatchNorm2d -> 1x1 Conv2d -> BatchNorm2d: the second BatchNorm's input has per-channel mean
  zero (a linear map of zero-mean channels), so its running_mean is only rounding; under bf16 autocast it stays
  exactly at its start (0.0) while the float32 reference's moves by ~1e-8.
- `kind="pointwise"`: a 1x1 Conv2d between BatchNorms: oneDNN sums its weight gradient in another order for a
  grad_output that is not 16-byte aligned.
Kwargs: `kind`, `channels` (8), `size` (16: the image's height and width).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.scale = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):  # (B, C, H, W)
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.scale * self.fc2(F.gelu(self.fc1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    def __init__(self, channels=8, num_classes=5):
        super().__init__()
        self.stem, self.stem_norm = nn.Conv2d(3, channels, 2, stride=2), nn.LayerNorm(channels)
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.head_norm, self.head = nn.LayerNorm(channels), nn.Linear(channels, num_classes)

    def forward(self, x):
        h = self.stem_norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # channels_last strides, as HF's
        h = self.head_norm(self.blocks(h).permute(0, 2, 3, 1))  # the blocks' gradient: a permuted view's
        return self.head(h.mean((1, 2)))


def build(batch_size, kind="convnext", channels=8, num_classes=5, size=16):
    torch.manual_seed(0)
    if kind == "convnext":
        model, x = ConvNeXtLike(channels, num_classes), torch.randn(batch_size, 3, size, size)
    elif kind == "zero_mean":  # 1x1 pixels, as MobileNetV2's last blocks on a 32x32 image: two values per channel
        model = nn.Sequential(nn.Conv2d(3, channels, 1), nn.BatchNorm2d(channels),
                              nn.Conv2d(channels, 6 * channels, 1, bias=False), nn.BatchNorm2d(6 * channels),
                              nn.ReLU(), nn.Flatten(), nn.Linear(6 * channels, num_classes))
        x = torch.randn(batch_size, 3, 1, 1)
    elif kind == "pointwise":  # MobileNetV2's first expansion: a 1x1 Conv2d between BatchNorms, 16x16 pixels
        model = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels),
                              nn.Conv2d(channels, 6 * channels, 1, bias=False), nn.BatchNorm2d(6 * channels),
                              nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6 * channels, num_classes))
        x = torch.randn(batch_size, 3, size, size)
    else:
        raise ValueError(f"unknown kind {kind!r}: convnext, zero_mean or pointwise")
    y = torch.randint(0, num_classes, (batch_size,))
    return model, (x,), lambda out: F.cross_entropy(out, y)
