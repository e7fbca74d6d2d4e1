"""Which dimensions of a model's device mesh DistributedDataParallel wraps (`record --data-parallel`).

Where this sits: `record/run.py` asks `ddp_over(choice, model)` before it runs a multi-rank iteration. A model that
parallelises itself places its parameters on some dimensions of a `DeviceMesh` (tensor parallelism on "tp",
FSDP2 on "dp"); the dimensions of the mesh none of its parameters is placed on are data parallel dimensions nothing
reduces over yet. The choice, per dimension:

- `auto` (the default): DDP over the dimensions the parameters leave free (a tensor-parallel model on the "tp"
  dimension of a ("dp", "tp") mesh: over "dp"; torchtitan's 2-D layout, FSDP2 on "dp" and tensor parallelism on "tp":
  none; a model on a 1-D mesh of every rank: none); a model without DTensor parameters: DDP over every rank, unless
  it carries Megatron-LM's marks of tensor- or expert-parallel layers (then none);
- `ddp`: as `auto`, and it is an error when no dimension is left (the model reduces every one itself); a model without
  a mesh: DDP over every rank, marks or not;
- `none`: no DDP;
- `DIM=ddp|none[,DIM=ddp|none...]` (`dp=ddp`, `dp=ddp,tp=none`): per named dimension of the model's mesh; DDP over
  the dimensions given `ddp` (several: over them flattened into one), none over the rest. A dimension the parameters
  are placed on cannot take DDP (it would average shards that differ by design).

The answer is None (no DDP), `WORLD` (DDP over the default group, as a plain model gets) or the 1-D `DeviceMesh` to
give `DistributedDataParallel(device_mesh=...)`, which for a sub-mesh of tensor-parallel parameters runs torch's
DDP + TP composition (`torch.distributed.tensor.parallel.ddp`: the parameters are local tensors outside forward).
"""

from __future__ import annotations

import re

from oneiter.errors import OneIterError
from oneiter.runtime.sharding import dtensor_class, parallelizes_itself

__all__ = ["CHOICES", "WORLD", "check_choice", "per_dimension", "ddp_over"]

CHOICES = ("auto", "ddp", "none")
WORLD = "world"  # DDP over the default process group
_DIM = re.compile(r"^(?P<dim>[A-Za-z_][\w]*)=(?P<how>ddp|none)$")


def per_dimension(choice: str) -> dict[str, str] | None:
    """`dp=ddp,tp=none` as {"dp": "ddp", "tp": "none"}; None for `auto`, `ddp`, `none`; OneIterError otherwise."""
    if choice in CHOICES:
        return None
    found: dict[str, str] = {}
    for part in choice.split(","):
        match = _DIM.match(part.strip())
        if match is None or match["dim"] in found:
            raise OneIterError(f"data_parallel must be one of {', '.join(CHOICES)} or DIM=ddp|none per mesh dimension "
                               f"(dp=ddp,tp=none), got '{choice}'", param="data_parallel")
        found[match["dim"]] = match["how"]
    return found


def check_choice(choice: str) -> None:
    """Refuse a `--data-parallel` value that is none of the forms above (before anything is built)."""
    per_dimension(choice)


def _placed(model):
    """(the root mesh of the model's DTensor parameters, the names of its dimensions, the names the parameters are
    placed on); None without DTensor parameters."""
    cls = dtensor_class()
    params = [p for p in model.parameters() if cls is not None and isinstance(p, cls)]
    if not params:
        return None
    root = params[0].device_mesh._get_root_mesh()
    names = tuple(root.mesh_dim_names or ())
    placed: set[str] = set()
    for p in params:
        mesh = p.device_mesh
        if mesh._get_root_mesh() != root:
            raise OneIterError("the model's parameters are DTensors on meshes of different roots: --data-parallel "
                               "cannot tell its dimensions apart; give none and wrap it in the builder",
                               param="data_parallel")
        placed.update(mesh.mesh_dim_names or names)
    return root, names, placed


def ddp_over(choice: str, model):
    """Where DistributedDataParallel wraps `model` (module docstring): None, `WORLD` or a 1-D DeviceMesh."""
    dims = per_dimension(choice)
    if choice == "none":
        return None
    found = _placed(model)
    if found is None:
        if dims is not None:
            raise OneIterError(f"--data-parallel {choice}: the model's parameters are not DTensors, so it has no "
                               f"device mesh whose dimensions to name; give ddp or none", param="data_parallel")
        return WORLD if choice == "ddp" or not parallelizes_itself(model) else None
    root, names, placed = found
    free = [n for n in names if n not in placed]
    if dims is None:
        if choice == "ddp" and not free:
            shown = f"({', '.join(names)})" if names else f"({root.ndim} unnamed)"
            raise OneIterError(f"--data-parallel ddp: every dimension of the model's mesh {shown} holds its "
                               f"parameters (FSDP2, tensor parallelism), none is left for DDP; leave --data-parallel "
                               f"at auto", param="data_parallel")
        wrap = free
    else:
        unknown = [d for d in dims if d not in names]
        if unknown:
            raise OneIterError(f"--data-parallel {choice}: the model's mesh has no dimension '{unknown[0]}' (its "
                               f"dimensions: {', '.join(names) or 'unnamed'})", param="data_parallel")
        wrap = [d for d in names if dims.get(d) == "ddp"]
        taken = [d for d in wrap if d in placed]
        if taken:
            raise OneIterError(f"--data-parallel {choice}: the model's parameters are placed on dimension "
                               f"'{taken[0]}' (FSDP2 or tensor parallelism reduce over it), so DDP cannot average "
                               f"over it; give it none", param="data_parallel")
    if not wrap:
        return None
    return root[wrap[0]] if len(wrap) == 1 else root[tuple(wrap)]._flatten()


def keep_parameters(module) -> dict:
    """torch's DDP over a sub-mesh of tensor-parallel parameters (`DistributedDataParallel(device_mesh=...)` runs
    `torch.distributed.tensor.parallel.ddp._pre_dp_module_transform`) turns each DTensor parameter into a plain
    Parameter of its local shard, rebuilds the DTensors from them before each forward and sets those in the modules'
    places: after the first forward the modules hold no parameters at all (`module.parameters()` is empty), and an
    optimizer built before the wrap steps tensors the model no longer uses. A forward hook put after torch's puts the
    local Parameters back when each forward returns, so the model's parameters stay the objects DDP reduces and an
    optimizer can step. Returns {id(the parameter before the wrap): the parameter after it}."""
    after = dict(module.named_parameters())
    places = [(*_owner(module, name), param) for name, param in after.items() if hasattr(param, "_st_info")]

    def restore(*_):
        for owner, attr, param in places:
            if owner._parameters.get(attr) is not param:
                if attr in owner.__dict__:
                    delattr(owner, attr)
                owner._parameters[attr] = param

    if places:
        module.register_forward_hook(restore)
    return after


def _owner(module, name: str):
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr
