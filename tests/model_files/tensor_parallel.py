"""Tensor-parallel MLPs as people write them, for `torchrun ... -m oneiter record`: pure torch, no oneiter.

- `build` (`tensor_parallel.py:build`): Megatron-style layers written by hand. `ColumnParallelLinear` holds its rank's
  rows of the weight (the output features) and hands its input to them through `copy_to_region` (identity forward,
  all-reduce of the gradient in backward); `RowParallelLinear` holds its rank's columns (the input features) and
  sums the partial outputs with `reduce_from_region` (all-reduce forward, identity backward), as Megatron-LM's
  tensor-parallel mappings do. The sharded parameters carry Megatron's `tensor_model_parallel` attribute.
- `build_dtensor` (`tensor_parallel.py:build_dtensor`): the same kind of model parallelised with
  `torch.distributed.tensor.parallel` as torchtitan applies it: the embedding `RowwiseParallel` into a
  sequence-sharded residual stream, the norms `SequenceParallel`, each feed-forward gathered by
  `PrepareModuleInput`, `w1` `ColwiseParallel`, `w2` `RowwiseParallel` back to sequence shards, the head
  `ColwiseParallel` with a replicated output.

Every rank of the tensor-parallel group (all ranks) builds the same full weights (a fixed generator) and the same
batch; each keeps its own slice. `build_steps` is `build` for several iterations, with a fault from a given step on.
`collective_fault=offset|bf16|drop` installs a wrong collective library first (`faulty_collectives.py`),
`fault_rank` and `fault_min_numel` tune it. One process builds the plain model."""

import faulty_collectives
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _tp() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if _tp()[1] > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad)
        return grad


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if _tp()[1] > 1:
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnParallelLinear(nn.Module):
    """y = x W_r^T + b_r: this rank's output features (rows r of the full weight)."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        rank, size = _tp()
        rows = full.out_features // size
        self.weight = nn.Parameter(full.weight.detach()[rank * rows:(rank + 1) * rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * rows:(rank + 1) * rows].clone())
        for p in (self.weight, self.bias):
            p.tensor_model_parallel = True

    def forward(self, x):
        return F.linear(_CopyToRegion.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: this rank's input features (columns r of the full weight)."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        rank, size = _tp()
        cols = full.in_features // size
        self.weight = nn.Parameter(full.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.weight.tensor_model_parallel = True
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return _ReduceFromRegion.apply(F.linear(x, self.weight)) + self.bias


class Block(nn.Module):
    def __init__(self, width: int, gen: torch.Generator):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = ColumnParallelLinear(_linear(width, 4 * width, gen))
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(_linear(4 * width, width, gen))

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TPMLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, gen: torch.Generator | None = None):
        super().__init__()
        self.inp = _linear(8, width, gen)
        self.blocks = nn.ModuleList(Block(width, gen) for _ in range(depth))
        self.out = _linear(width, 4, gen)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _linear(fan_in: int, fan_out: int, gen: torch.Generator) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(fan_out, fan_in, generator=gen) / fan_in ** 0.5)
        layer.bias.copy_(torch.randn(fan_out, generator=gen) * 0.1)
    return layer


def _fault(collective_fault: str, fault_rank: int, fault_min_numel: int) -> None:
    if collective_fault:
        faulty_collectives.install(collective_fault, rank=fault_rank, min_numel=fault_min_numel)
    else:
        faulty_collectives.uninstall()


def build(batch_size, width=16, depth=2, collective_fault="", fault_rank=1, fault_min_numel=0):
    _fault(collective_fault, fault_rank, fault_min_numel)
    gen = torch.Generator().manual_seed(1234)  # the same full weights and batch on every rank
    model = TPMLP(width, depth, gen)
    x = torch.randn(batch_size, 8, generator=gen)
    y = torch.randint(0, 4, (batch_size,), generator=gen)
    return model, (x,), lambda out: F.cross_entropy(out, y.to(out.device))


def build_steps(batch_size, wrong_from=-1, fault_rank=1):
    """`build` for several iterations: `batch(step)` draws step's batch from its own generator, scaled by 1 + step;
    `wrong_from=S` makes rank `fault_rank`'s `inp` layer 5 % off from the step whose inputs reach S in magnitude (a
    kernel wrong for large values only, written into the model, as a vendor's would be)."""
    model, _, _ = build(batch_size)
    rank = _tp()[0]
    if wrong_from >= 0 and rank == fault_rank:
        model.inp.register_forward_hook(lambda _m, args, out: out * 1.05 if args[0].abs().max() >= wrong_from else None)

    def batch(step):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(batch_size, 8, generator=gen).clamp(-2, 2) * (1 + step)
        y = torch.randint(0, 4, (batch_size,), generator=gen)
        return (x,), lambda out: F.cross_entropy(out, y.to(out.device))

    inputs, loss_fn = batch(0)
    return model, inputs, loss_fn, None, batch


# -- torch.distributed.tensor.parallel ------------------------------------------------------------------------------
class FeedForward(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.w1 = nn.Linear(width, 4 * width)
        self.w2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class FFBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ffn_norm = nn.LayerNorm(width)
        self.feed_forward = FeedForward(width)

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


class TokenMLP(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(FFBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: TokenMLP) -> TokenMLP:
    """torchtitan's plan for a llama, the attention left out."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def build_dtensor(batch_size, seq_len=8, depth=2, collective_fault="", fault_rank=1, fault_min_numel=0):
    _fault(collective_fault, fault_rank, fault_min_numel)
    torch.manual_seed(1234)  # parallelize_module distributes rank 0's weights; the batch is every rank's
    model = TokenMLP(depth=depth)
    if _tp()[1] > 1:
        parallelize(model)
    tokens = torch.randint(0, 32, (batch_size, seq_len))
    labels = torch.randint(0, 32, (batch_size, seq_len))
    return model, (tokens,), lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten().to(out.device))
