"""Sharded parameters (FSDP2's `fully_shard`: DTensor parameters, each rank holding a shard): oneiter's unit is the
rank's own shard.

Where this sits: the recording session writes parameters, gradients and updated parameters through `shard_of()` (each
rank's file holds its shard, with `shard_attrs` saying where it sits in the full tensor: docs/format.md), the
replay loads the reference's shard of rank R into rank R's shard (`load_local`), and `record/run.py` leaves a model
that sharded itself unwrapped (`is_sharded`: no DistributedDataParallel around FSDP2). No collective runs here:
rank R's file is rank R's own, as under DDP.

Only torch's `DTensor` is recognised (`torch.distributed.tensor`); without torch.distributed nothing is sharded.
"""

from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["dtensor_class", "is_dtensor", "shard_of", "placement_of", "is_sharded", "is_fsdp", "parallelizes_itself",
           "reduction", "grads_reduced", "class_name", "as_placed", "is_fsdp_hook", "spec_of", "to_placed",
           "parse_placements", "GatheredThroughCall"]


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


def shard_of(tensor):
    """This rank's shard of a DTensor (its plain local tensor, no copy), and the result of a collective still
    under way (an `AsyncCollectiveTensor`: what a tensor-parallel style's output is) waited for; any other tensor
    as it is."""
    if is_dtensor(tensor):
        tensor = tensor.to_local()
    if type(tensor).__name__ == "AsyncCollectiveTensor" and callable(getattr(tensor, "trigger_wait", None)):
        tensor = tensor.trigger_wait()
    return tensor


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
    """Whether any parameter of the model is a DTensor (FSDP2's `fully_shard`, `torch.distributed.tensor.parallel`)."""
    return any(is_dtensor(p) for p in model.parameters())


def is_fsdp(model) -> bool:
    """Whether FSDP2's `fully_shard` manages the model or a module of it (FSDP2 reduces their gradients)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


# Megatron-LM's marks on the parameters its tensor- and expert-parallel layers hold: a slice of the full weight
# (`tensor_model_parallel`), or an expert's own weight that data parallelism must not average (`allreduce` False)
_MEGATRON_MARKS = (("tensor_model_parallel", True), ("allreduce", False))


def is_fsdp_hook(hook) -> bool:
    """A module hook of FSDP2 (`fully_shard`): it all-gathers and reshards parameters (collectives every rank must
    join) and registers the gradient reduction."""
    return str(getattr(hook, "__module__", "") or "").startswith("torch.distributed.fsdp")


def parallelizes_itself(model) -> bool:
    """Whether the model splits itself across ranks, so that wrapping it in DistributedDataParallel (which makes
    every rank's parameters rank 0's) would be wrong: a DTensor parameter (FSDP2, `torch.distributed.tensor
    .parallel`), or a parameter with Megatron-LM's marks of a tensor- or expert-parallel layer."""
    if is_sharded(model):
        return True
    return any(getattr(p, mark, None) is value for p in model.parameters() for mark, value in _MEGATRON_MARKS)


def reduction(model, world_size: int, reduced: bool = False) -> str:
    """How this run's parameter gradients were reduced over ranks when they were recorded (the file's
    `grad_reduction`): `reduce_scatter_mean` (FSDP2: each rank holds its shard of the mean), `allreduce_mean`
    (`reduced`: DistributedDataParallel's reducer averaged them in backward, so every rank holds the mean), or
    `none` (one rank; or a model that parallelises itself without data parallelism: each rank's own)."""
    if world_size <= 1:
        return "none"
    if is_fsdp(model):
        return "reduce_scatter_mean"
    return "allreduce_mean" if reduced else "none"


def grads_reduced(meta: dict) -> bool:
    """Whether a recording's parameter gradients were reduced over ranks (its root attribute `grad_reduction`, see
    `reduction`; a file without it: whether it had several ranks, which were then always DDP's or FSDP2's)."""
    how = meta.get("grad_reduction")
    return how != "none" if isinstance(how, str) and how else int(meta.get("world_size") or 1) > 1


def spec_of(tensor) -> tuple | None:
    """(mesh, placements, global shape, global stride) of a DTensor, which `to_placed` puts a shard back into;
    None for any other tensor."""
    if not is_dtensor(tensor):
        return None
    return tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride())


def to_placed(value, spec: tuple | None, placements=None):
    """The plain tensor `value` (this rank's shard) as a DTensor of `spec` (`spec_of`), with `placements` instead of
    the spec's when given; `value` itself without a spec."""
    if spec is None:
        return value
    mesh, own, shape, stride = spec
    return dtensor_class().from_local(value, mesh, placements or own, run_check=False, shape=shape, stride=stride)


_PLACEMENT = re.compile(r"(Shard)\(dim=(-?\d+)\)|(Replicate)\(\)|(Partial)\((?:reduce_op=)?'?(\w+)'?\)")


def parse_placements(text: str) -> tuple | None:
    """The placements a recording wrote (`Shard(dim=1),Replicate()`: `placement_of`) as torch's objects; None for
    text that is not a list of them."""
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
    except ImportError:
        return None
    found: list[Any] = []
    for part in re.findall(r"\w+\([^()]*\)", str(text)):
        match = _PLACEMENT.fullmatch(part)
        if match is None:
            return None
        if match[1]:
            found.append(Shard(int(match[2])))
        elif match[3]:
            found.append(Replicate())
        else:
            found.append(Partial(match[5]))
    return tuple(found) or None


def as_placed(value, like):
    """`value` (a plain tensor holding this rank's shard) as a DTensor placed as `like` is, when `like` is a DTensor
    (a tensor-parallel weight a rerun swaps in); otherwise `value` as it is."""
    if not is_dtensor(like) or is_dtensor(value):
        return value
    return dtensor_class().from_local(value, like.device_mesh, like.placements, run_check=False,
                                      shape=like.shape, stride=like.stride())


class GatheredThroughCall:
    """An FSDP2 unit whose call is rerun as a whole keeps its parameters all-gathered from its forward until its rerun
    is done: `before` (a pre-hook, first of all) stops FSDP2 from resharding them when the forward returns, `after`
    (a post-hook, after the probe's) reshards them, as FSDP2 would have, and `remove` puts FSDP2's setting back.

    Why: a unit is rerun when its call returns, and FSDP2 reshards its parameters at the end of its forward. An
    eager unit's rerun forces its children (they were rerun while the parameters were gathered); a compiled unit
    hides its children in its graph, so its rerun computes with its parameters themselves. Nothing communicates: the
    rerun uses the all-gather of the live call, and the backward all-gathers as it would have. Only a unit that
    reshards to its own mesh after forward (FSDP2's default, `reshard_after_forward=True`) is held. `paused()` says
    when the hooks must do nothing (inside a rerun, which calls the unit again)."""

    def __init__(self, module, paused: Callable[[], bool] = lambda: False):
        self.paused = paused
        unit = getattr(module, "_orig_mod", module)  # torch.compile(unit)'s wrapper holds the unit
        state = unit._get_fsdp_state() if callable(getattr(unit, "_get_fsdp_state", None)) else None
        groups = list(getattr(state, "_fsdp_param_groups", None) or [])
        self._groups = [g for g in groups if getattr(g, "post_forward_mesh_info", None) is not None
                        and g.post_forward_mesh_info is getattr(g, "mesh_info", None)]
        self._held: list = []

    def __bool__(self) -> bool:
        return bool(self._groups)

    def before(self, *_args) -> None:
        if self.paused():
            return
        self._release()
        for group in self._groups:
            self._held.append((group, group.post_forward_mesh_info))
            group.post_forward_mesh_info = None

    def after(self, *_args) -> None:
        if self.paused():
            return
        held = list(self._held)
        self._release()
        for group, _info in held:
            group.reshard()

    def _release(self) -> None:
        while self._held:
            group, info = self._held.pop()
            group.post_forward_mesh_info = info

    def remove(self) -> None:
        self._release()


def class_name(model) -> str:
    """The model's class name; for a module FSDP2 sharded (its class becomes `FSDP<Name>`), the class it was."""
    cls = type(model)
    for base in cls.__bases__:
        if cls.__name__ == f"FSDP{base.__name__}":
            return base.__name__
    return cls.__name__
