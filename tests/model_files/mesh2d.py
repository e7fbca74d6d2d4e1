"""Two-dimensional meshes on 4 ranks, as torchtitan lays them out, for `torchrun --nproc-per-node 4 -m oneiter record`:
pure torch, no oneiter.

`build(batch_size, layout=...)` makes a `DeviceMesh` of shape (2, 2) named ("dp", "tp") and applies to
`tensor_parallel.TokenMLP` torchtitan's tensor-parallel plan on the "tp" dimension (the embedding `RowwiseParallel`
into a sequence-sharded residual stream, the norms `SequenceParallel`, each feed-forward's `w1` `ColwiseParallel`
and `w2` `RowwiseParallel`, the head `ColwiseParallel` with a replicated output); then

- `layout="fsdp"`: FSDP2 on the "dp" dimension, per block and on the root (torchtitan's 2-D: `fully_shard(block,
  mesh=dp_mesh)`), so each parameter is a DTensor over both dimensions;
- `layout="tp"`: nothing more: data parallelism over "dp" is left to whoever runs it (`oneiter record
  --data-parallel` wraps the model in DDP over the dimensions its parameters are not placed on: here "dp").

Every rank builds the same full weights (a fixed seed); the batch is the data-parallel rank's own (a generator
seeded by its "dp" coordinate), the same on both ranks of a tensor-parallel group, as tensor parallelism needs. One
process builds the plain model with a batch of its own."""

import tensor_parallel
import torch
import torch.distributed as dist
import torch.nn.functional as F

LAYOUTS = ("fsdp", "tp")


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != 4:
        raise ValueError(f"mesh2d builds a 2 x 2 mesh: run it with 4 ranks, not {dist.get_world_size()}")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tensor_parallel(model, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def build(batch_size, layout="fsdp", seq_len=8, depth=2):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    torch.manual_seed(1234)
    model = tensor_parallel.TokenMLP(depth=depth)
    dp_rank = 0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mesh = _mesh()
        dp_rank = mesh["dp"].get_local_rank()
        _tensor_parallel(model, mesh["tp"])
        if layout == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    gen = torch.Generator().manual_seed(100 + dp_rank)
    tokens = torch.randint(0, 32, (batch_size, seq_len), generator=gen)
    labels = torch.randint(0, 32, (batch_size, seq_len), generator=gen)
    return model, (tokens,), lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten().to(out.device))
