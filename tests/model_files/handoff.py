"""A stack of blocks handing a value from block to block, each consuming it and returning it (T5's position_bias).

The first block computes an attention-like bias from its input (`softplus(bias(mean over tokens))`, in its own
code), adds it inside, and returns it with its output; the root's loop passes it into every later block, which
adds it too and returns the same tensor, unchanged; the root returns it beside the logits, and the loss uses
both. The bias's recorded gradient (a hook on that one tensor) is the sum over all its consumers, while each
block's `grad_input` for it holds only that block's own consumption. Kwargs: `seq_len` (6), `dim` (16), `depth` (3).

Fault targets (env ONEITER_TEST_FAULT, see faultkit), where they live:
- `function_bwd:softplus`                       `blocks.0`, own code (only the first block makes the bias; its
                                                backward runs after every later block's)
- `function:softplus`                           `blocks.0`, own code
- `function_bwd:gelu`                           `blocks.2.act` (backward meets the last block first)
- `instance:blocks.2.out`, `instance:blocks.1`, `class:Block`, `root` (the root's own scaling of the logits)
"""

import torch
import torch.nn as nn
from faultkit import apply_fault, fault_scale, patch_functions, undo_faults  # noqa: F401


class Block(nn.Module):
    def __init__(self, dim: int, first: bool):
        super().__init__()
        self.bias = nn.Linear(dim, dim) if first else None  # only the first block makes the bias
        self.mix = nn.Linear(dim, dim)
        self.act = nn.GELU()
        self.out = nn.Linear(dim, dim)

    def forward(self, x, bias=None):
        if bias is None:
            bias = torch.nn.functional.softplus(self.bias(x.mean(1, keepdim=True)))
        return x + self.out(self.act(self.mix(x) + bias)), bias


class HandOff(nn.Module):
    def __init__(self, dim: int, depth: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, i == 0) for i in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h, bias = self.embed(x), None
        for block in self.blocks:
            h, bias = block(h, bias)
        return self.head(h) * fault_scale(), bias


def build(batch_size, seq_len=6, dim=16, depth=3, classes=5):
    patch_functions()
    model = HandOff(dim, depth, classes)
    x = torch.randn(batch_size, seq_len, dim)
    target = torch.randint(0, classes, (batch_size * seq_len,))

    def loss_fn(out):
        logits, bias = out
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, classes), target.to(logits.device))
        return ce + 0.1 * bias.float().square().mean()

    return apply_fault(model), (x,), loss_fn
