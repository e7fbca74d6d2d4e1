"""A stand-in vendor collective library that is wrong, registered the way a device plugin registers its collectives:
`torch.library` kernels over torch's `c10d` ops for one backend (here the CPU, which gloo serves), installed by the
model's builder before anything communicates. Pure torch: it never imports or consults oneiter.

`install(kind, rank=1, rel=1e-3, min_numel=0)`:

- `offset`: on rank `rank`, the result of every all-reduce, reduce-scatter (also the coalesced one functional
  collectives and DTensor use) and all-to-all is (1 + rel) times the right one (a library 0.1 % off on one chip);
- `bf16`: every all-reduce and reduce-scatter accumulates the ranks' contributions in bfloat16, whatever the dtype
  (a library that reduces float32 in a lower precision), on every rank;
- `drop`: a sum of `min_numel` or more elements leaves out the last rank's contribution (a library that loses one
  peer's message above a size), on every rank;
- `fail`: on rank `rank`, every all-reduce raises the RuntimeError gloo raises when a peer closed its connection
  (another rank that stopped).

Every kernel computes the right result with gloo's own implementation (the `Backend` of the group, which these
kernels do not replace), then makes it wrong. `uninstall()` puts torch's kernels back (a process that builds twice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceScatterOptions

KINDS = ("offset", "bf16", "drop", "fail")
_LIB: list = []


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()


def install(kind: str, rank: int = 1, rel: float = 1e-3, min_numel: int = 0) -> None:
    """Register the wrong kernels (see the module docstring); a second call replaces the first."""
    if kind not in KINDS:
        raise ValueError(f"collective fault must be one of {KINDS}, got {kind!r}")
    uninstall()
    lib = torch.library.Library("c10d", "IMPL")
    _LIB.append(lib)
    fault = _Fault(kind, rank, rel, min_numel)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        lib.impl("allreduce_", fault.allreduce, "CPU")
        lib.impl("_reduce_scatter_base_", fault.reduce_scatter, "CPU")
        lib.impl("reduce_scatter_tensor_coalesced_", fault.reduce_scatter_coalesced, "CPU")  # functional, DTensor
        lib.impl("alltoall_base_", fault.alltoall, "CPU")


def _done(tensors):
    """A completed Work (boxed): waiting again must not let gloo copy its own result over the faulty one."""
    future = torch.futures.Future()
    future.set_result(tensors)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def _backend(process_group):
    return dist.ProcessGroup.unbox(process_group)._get_backend(torch.device("cpu"))


def _op(reduce_op) -> dist.ReduceOp:
    return dist.ReduceOp(dist.ReduceOp.RedOpType(reduce_op.op()))


class _Fault:
    def __init__(self, kind: str, rank: int, rel: float, min_numel: int):
        self.kind, self.rank, self.rel, self.min_numel = kind, rank, rel, min_numel

    def _offset(self, tensor) -> None:
        if self.kind == "offset" and dist.get_rank() == self.rank and tensor.is_floating_point():
            tensor.mul_(1.0 + self.rel)

    def _contributions(self, backend, tensor) -> list:
        """Every rank's input, gathered with gloo's own all-gather."""
        gathered = [torch.empty_like(tensor) for _ in range(backend.size())]
        backend.allgather([gathered], [tensor], AllgatherOptions()).wait()
        return gathered

    def _wrong_sum(self, parts: list):
        """The sum as the faulty library computes it, or None where it is right."""
        if self.kind == "bf16":
            acc = parts[0].to(torch.bfloat16)
            for part in parts[1:]:
                acc = acc + part.to(torch.bfloat16)  # rounded to bfloat16 at every step
            return acc.to(parts[0].dtype)
        if self.kind == "drop" and parts[0].numel() >= self.min_numel:
            acc = parts[0].clone()
            for part in parts[1:-1]:
                acc += part
            return acc
        return None

    def allreduce(self, tensors, process_group, reduce_op, sparse_indices, async_op=True, timeout=-1):
        if self.kind == "fail" and dist.get_rank() == self.rank:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:14240")
        backend = _backend(process_group)
        op = _op(reduce_op)
        if op == dist.ReduceOp.SUM and self.kind in ("bf16", "drop") and tensors[0].is_floating_point():
            for tensor in tensors:
                wrong = self._wrong_sum(self._contributions(backend, tensor))
                if wrong is not None:
                    tensor.copy_(wrong)
            work = backend.barrier()
        else:
            opts = AllreduceOptions()
            opts.reduceOp = op
            work = backend.allreduce(tensors, opts)
        work.wait()
        for tensor in tensors:
            self._offset(tensor)
        return tensors, _done(tensors)

    def reduce_scatter(self, output, input, process_group, reduce_op, async_op=True, timeout=-1):
        backend = _backend(process_group)
        op = _op(reduce_op)
        wrong = None
        if op == dist.ReduceOp.SUM and self.kind in ("bf16", "drop") and input.is_floating_point():
            wrong = self._wrong_sum(self._contributions(backend, input))
        if wrong is not None:
            output.copy_(wrong.chunk(backend.size())[backend.rank()])
            work = backend.barrier()
        else:
            opts = ReduceScatterOptions()
            opts.reduceOp = op
            work = backend._reduce_scatter_base(output, input, opts)
        work.wait()
        self._offset(output)
        return output, _done([output])

    def reduce_scatter_coalesced(self, outputs, inputs, process_group, reduce_op, async_op=True, timeout=-1):
        for output, input in zip(outputs, inputs, strict=True):
            self.reduce_scatter(output, input, process_group, reduce_op)
        return _done(list(outputs))

    def alltoall(self, output, input, process_group, output_split_sizes, input_split_sizes, async_op=True,
                 timeout=-1):
        work = _backend(process_group).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                     AllToAllOptions())
        work.wait()
        self._offset(output)
        return _done([output])
