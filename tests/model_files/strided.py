"""Token mixing on views: a Linear fed a transposed slice of a larger buffer (strides and a storage offset).

`StridedMixer` embeds tokens into (B, T+1, C) with a leading summary token, then each block mixes the T tokens
with `fc` applied to `h[:, 1:].transpose(1, 2)`: a non-contiguous view whose storage offset is C (the summary
token is skipped), as token-mixing layers and NPU-format tensors hand kernels. Kwargs: `tokens` (6), `dim` (8),
`depth` (2), `num_classes` (5).

Fault targets (env ONEITER_TEST_FAULT, see faultkit), where they live:
- `stride:linear`      `blocks.0.fc` forward: F.linear wrong only for its strided input (the channel Linear
                       `blocks.0.proj` gets a contiguous one and stays exact)
- `stride_bwd:linear`  `blocks.1.fc` backward (backward meets the last block first): the gradient w.r.t. the
                       strided input is wrong, the forward exact
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests)


class Block(nn.Module):
    def __init__(self, tokens, dim):
        super().__init__()
        self.fc = nn.Linear(tokens, tokens)
        self.proj = nn.Linear(dim, dim)

    def forward(self, h):  # (B, T+1, C)
        mixed = self.fc(h[:, 1:].transpose(1, 2)).transpose(1, 2)  # the Linear sees (B, C, T) strided, offset C
        body = h[:, 1:] + F.gelu(self.proj(mixed.contiguous()))
        return torch.cat([h[:, :1] + body.mean(1, keepdim=True), body], dim=1)


class StridedMixer(nn.Module):
    def __init__(self, tokens=6, dim=8, depth=2, num_classes=5):
        super().__init__()
        self.embed = nn.Linear(3, dim)
        self.summary = nn.Parameter(0.1 * torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList(Block(tokens, dim) for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):  # (B, T, 3)
        h = self.embed(x)
        h = torch.cat([self.summary.expand(h.shape[0], 1, -1), h], dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, 0] + h[:, 1:].mean(1))  # a contiguous input: only the blocks' fc are strided


def build(batch_size, tokens=6, dim=8, depth=2, num_classes=5):
    patch_functions()
    model = StridedMixer(tokens, dim, depth, num_classes)
    x = torch.randn(batch_size, tokens, 3)
    y = torch.randint(0, num_classes, (batch_size,))
    return apply_fault(model), (x,), lambda out: F.cross_entropy(out, y)
