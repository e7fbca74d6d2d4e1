"""Sharded parameters (FSDP2's `fully_shard`: DTensor parameters, each rank holding a shard): oneiter's unit is the
rank's own shard.

Where this sits: the recording session writes parameters, gradients and updated parameters through `local()` (each
rank's file holds its shard, with `shard_attrs` saying where it sits in the full tensor: docs/format.md), the
replay loads the reference's shard of rank R into rank R's shard (`load_local`), and `record/run.py` leaves a model
that sharded itself unwrapped (`is_sharded`: no DistributedDataParallel around FSDP2). No collective runs here:
rank R's file is rank R's own, as under DDP.

Only torch's `DTensor` is recognised (`torch.distributed.tensor`); without torch.distributed nothing is sharded.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dtensor_class", "is_dtensor", "local", "placement_of", "is_sharded", "reduction", "class_name"]


def dtensor_class() -> Any:
    """torch's DTensor class, or None (a torch without torch.distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor  # torch < 2.4
        except ImportError:
            return None
    return DTensor


def is_dtensor(tensor) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def local(tensor):
    """This rank's shard of a DTensor (its plain local tensor, no copy); any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def placement_of(tensor) -> tuple[str, tuple[int, ...], tuple[int, ...] | None] | None:
    """Where this rank's shard sits in the full tensor: its placements (`"Shard(dim=0)"`, one per mesh dimension,
    joined by `,`), the full tensor's shape and the shard's offset in it (its first element's index in every
    dimension; None where torch cannot say). None for a tensor that is not a DTensor (`schema.shard_attrs`
    names them in the file)."""
    if not is_dtensor(tensor):
        return None
    offset = None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        offset = tuple(int(n) for n in compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                               tensor.placements)[1])
    except Exception:  # a torch without that helper: the offset is left out (documented as optional)
        pass
    return ",".join(repr(p) for p in tensor.placements), tuple(int(n) for n in tensor.shape), offset


def is_sharded(model) -> bool:
    """Whether any parameter of the model is a DTensor (the model applied FSDP2's `fully_shard` to itself)."""
    return any(is_dtensor(p) for p in model.parameters())


def reduction(model, world_size: int) -> str:
    """How this run's parameter gradients were reduced over ranks (the file's `grad_reduction`): `none` (one rank),
    `allreduce_mean` (DistributedDataParallel: every rank holds the mean), `reduce_scatter_mean` (FSDP2: each rank
    holds its shard of the mean)."""
    if world_size <= 1:
        return "none"
    return "reduce_scatter_mean" if is_sharded(model) else "allreduce_mean"


def class_name(model) -> str:
    """The model's class name; for a module FSDP2 sharded (its class becomes `FSDP<Name>`), the class it was."""
    cls = type(model)
    for base in cls.__bases__:
        if cls.__name__ == f"FSDP{base.__name__}":
            return base.__name__
    return cls.__name__
