"""One small model for every way of running it: a plain module (one process, or wrapped in DDP by oneiter under
torchrun), sharded by FSDP2, or split by tensor parallelism — each with activation checkpointing, a fault in its own
code and a batch per step, so one file serves the whole feature matrix (`tests/runtime/test_feature_matrix.py`).

`build(batch_size, parallel="", checkpointing="", fault="", fault_rank=-1, fault_from=0, rel=0.05)`:
- the model: `inp` (Linear 8 -> 16), two residual blocks `blocks.i` (LayerNorm, `up` 16 -> 32, GELU, `down` 32 -> 16),
  `out` (Linear 16 -> 4); its weights and batches come from generators of its own, the same on every rank;
- `parallel`: "" (plain: one process, or DDP, which oneiter wraps around it under torchrun), "fsdp2"
  (`fully_shard` on every block, then the root), "tp" (`torch.distributed.tensor.parallel`: every block's `up`
  `ColwiseParallel`, its `down` `RowwiseParallel`; the ranks share one batch, as a tensor-parallel group does);
  a single process builds it plain whatever `parallel` says;
- `checkpointing`: "non_reentrant" or "reentrant" checkpoints every block's body (`torch.utils.checkpoint`);
- `fault`: the module path of a linear layer (`blocks.1.up`) whose output its own forward scales by 1 + `rel` —
  code of the model, so inside a compiled block too — on rank `fault_rank` (-1: every rank), from step `fault_from`
  on (the step `batch(step)` was last asked for);
- it returns the model contract's five items: `batch(step)` draws step's batch from a generator seeded by the step
  (and the rank, except under tensor parallelism), so a replay of any step gets the step's own batch.
Pure torch, no oneiter."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

_STEP = {"now": 0}


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class FaultyLinear(nn.Linear):
    """nn.Linear whose output is scaled by `scale` from step `start` on (scale 1.0: exact, not a bit changed)."""

    scale, start = 1.0, 0

    def forward(self, x):
        out = super().forward(x)
        if self.scale != 1.0 and _STEP["now"] >= self.start:
            out = out * self.scale
        return out


class Block(nn.Module):
    def __init__(self, width: int, checkpointing: str):
        super().__init__()
        self.checkpointing = checkpointing
        self.norm = nn.LayerNorm(width)
        self.up = FaultyLinear(width, 2 * width)
        self.act = nn.GELU()
        self.down = FaultyLinear(2 * width, width)

    def body(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))

    def forward(self, x):
        if self.checkpointing:
            return checkpoint(self.body, x, use_reentrant=self.checkpointing == "reentrant")
        return self.body(x)


class Matrix(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, checkpointing: str = ""):
        super().__init__()
        self.inp = FaultyLinear(8, width)
        self.blocks = nn.ModuleList(Block(width, checkpointing) for _ in range(depth))
        self.out = FaultyLinear(width, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _parallelize(model: Matrix, parallel: str) -> None:
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif parallel == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    elif parallel:
        raise ValueError(f"parallel must be '', 'fsdp2' or 'tp', got {parallel!r}")


def build(batch_size, parallel="", checkpointing="", fault="", fault_rank=-1, fault_from=0, rel=0.05):
    rank, world = _rank_world()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # the same full weights on every rank
        model = Matrix(checkpointing=checkpointing)
    if fault and fault_rank in (-1, rank):
        layer = model.get_submodule(fault)
        layer.scale, layer.start = 1.0 + float(rel), int(fault_from)
    if world > 1:
        _parallelize(model, parallel)
    shared = parallel == "tp"  # a tensor-parallel group computes on one batch

    def batch(step):
        _STEP["now"] = step
        gen = torch.Generator().manual_seed(100 + step + (0 if shared else 1000 * rank))
        x = torch.randn(batch_size, 8, generator=gen)
        y = torch.randint(0, 4, (batch_size,), generator=gen)
        return (x,), lambda out: F.cross_entropy(out, y.to(out.device))

    inputs, loss_fn = batch(0)
    return model, inputs, loss_fn, None, batch
