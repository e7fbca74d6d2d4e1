"""A user model whose blocks run under `torch.utils.checkpoint` (`checkpointing="reentrant"` or
`"non_reentrant"`; `""`: not checkpointed), each region holding a block (with dropout inside, and a second
checkpoint nested in the first) and a module shared by every region (`squash`); faultable from inside (faultkit):
`instance:blocks.1.down`, `function_bwd:gelu` (the blocks' `act`), `instance:squash`."""

import torch
import torch.nn as nn
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests recording in one process)
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int, checkpointing: str):
        super().__init__()
        self.checkpointing = checkpointing
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(2 * width, width)

    def inner(self, x):
        return self.act(self.up(self.norm(x)))

    def forward(self, x):
        if self.checkpointing:  # nested in the region its caller checkpoints
            h = checkpoint(self.inner, x, use_reentrant=self.checkpointing == "reentrant")
        else:
            h = self.inner(x)
        return x + self.down(self.drop(h))


class Checkpointed(nn.Module):
    def __init__(self, checkpointing: str, width: int = 16, depth: int = 2):
        super().__init__()
        self.checkpointing = checkpointing
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, checkpointing) for _ in range(depth))
        self.squash = nn.Tanh()  # called inside every checkpointed region
        self.out = nn.Linear(width, 4)

    def region(self, block, h):
        return self.squash(block(h)) * 0.5 + h

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.checkpointing:
                h = checkpoint(self.region, block, h, use_reentrant=self.checkpointing == "reentrant")
            else:
                h = self.region(block, h)
        return self.out(h)


def build(batch_size, checkpointing="non_reentrant"):
    patch_functions()
    if checkpointing not in ("reentrant", "non_reentrant", ""):
        raise ValueError(f"checkpointing must be reentrant, non_reentrant or '', got {checkpointing!r}")
    model = Checkpointed(checkpointing)
    x = torch.randn(batch_size, 8)
    y = torch.randint(0, 4, (batch_size,))
    return apply_fault(model), (x,), lambda out: nn.functional.cross_entropy(out, y.to(out.device))
