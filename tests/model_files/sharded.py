"""A model that shards itself with FSDP2 in its builder, as torchtitan does: `fully_shard` on every block, then on
the root (under torchrun; a single process builds it unsharded). `checkpointing="non_reentrant"` or `"reentrant"`
also checkpoints every block (torch.utils.checkpoint inside the block's forward, as torchtitan's per-block
wrappers do). Pure torch: `torchrun --nproc-per-node 2 -m oneiter record -m tests/model_files/sharded.py:build`."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int, checkpointing: str):
        super().__init__()
        self.checkpointing = checkpointing
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def body(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))

    def forward(self, x):
        if self.checkpointing:
            return checkpoint(self.body, x, use_reentrant=self.checkpointing == "reentrant")
        return self.body(x)


class Sharded(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, checkpointing: str = ""):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, checkpointing) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def shard(model: Sharded) -> Sharded:
    """FSDP2 per block, then the root (the root's own parameters: `inp`, `out`)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def build(batch_size, checkpointing=""):
    model = Sharded(checkpointing=checkpointing)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shard(model)
    x = torch.randn(batch_size, 8)
    y = torch.randint(0, 4, (batch_size,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y.to(out.device))
