"""`record --replay`: start the target from the reference's initial weights, buffers and batch.

The model is still built from its spec (so closures such as the loss's labels are rebuilt with the reference's
seed), then its state and inputs are overwritten with the reference's bits after a structure check that names
the first mismatching parameter or shape.
"""

from __future__ import annotations

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import PARAM_GRADS
from oneiter.runtime.names import module_paths, parameters, state_tensors
from oneiter.runtime.sharding import is_dtensor, shard_of

__all__ = ["check_structure", "load_state"]


def check_structure(model, ref: IterationFile) -> None:
    """Raise OneIterError naming the first parameter/buffer whose name or shape differs from the reference (a
    sharded parameter's shape is this rank's shard's: what the rank's file holds)."""
    mine = {name: tuple(shard_of(t).shape) for name, t, _ in state_tensors(model)}
    theirs = ref.state()
    where = f"the reference '{ref.path.name}' (model {ref.meta.get('model', '?')})"
    for name, path in theirs.items():
        if name not in mine:
            raise OneIterError(f"model structure does not match {where}: it has '{name}', this model does not")
        if mine[name] != ref.shape_of(path):
            raise OneIterError(
                f"model structure does not match {where}: '{name}' has shape {list(ref.shape_of(path))} there, "
                f"{list(mine[name])} here"
            )
    for name in mine:
        if name not in theirs:
            raise OneIterError(f"model structure does not match {where}: this model has '{name}', the reference "
                               "does not")
    _check_modules(model, ref, where)
    _check_parameters(model, ref, where)


# the end of each structure message: what built a model other than the reference's, and what to do
_BUILT_OTHERWISE = "built with other arguments than the reference's? build it as the reference was (its model_args)"


def _check_modules(model, ref: IterationFile, where: str) -> None:
    """Every module the reference called exists here. A model built with other arguments can keep its state_dict
    and still differ here (torchtitan's fused QKV keeps `wqkv` as a module and a parameter, while its state_dict
    hooks name it `wq/wk/wv`). Classes are not compared: a vendor's stack may swap a module for its own fused one."""
    mine = {path for path, _ in module_paths(model)}  # a compiled model's by its eager names
    for _key, attrs in ref.calls():
        path = str(attrs.get("module", ""))
        if path not in mine:
            raise OneIterError(f"model structure does not match {where}: it called module '{path}' "
                               f"({attrs.get('class_name', '?')}), which this model does not have ({_BUILT_OTHERWISE})")


def _check_parameters(model, ref: IterationFile, where: str) -> None:
    """Every parameter the reference has a gradient of (by its name as `runtime/names.py` names parameters) exists
    here with its shape (a sharded one: this rank's shard, or the whole parameter's for a gradient placed otherwise
    than its parameter: tensor parallelism's `Replicate` gradient of a `Shard(0)` embedding)."""
    mine = {name: tuple(shard_of(p).shape) for name, p in parameters(model)}
    whole = {name: tuple(p.shape) for name, p in parameters(model) if is_dtensor(p)}
    for name, path in ref.state(PARAM_GRADS).items():
        if name not in mine:
            raise OneIterError(f"model structure does not match {where}: it has parameter '{name}', this model "
                               f"does not ({_BUILT_OTHERWISE})")
        if ref.shape_of(path) not in (mine[name], whole.get(name)):
            raise OneIterError(f"model structure does not match {where}: parameter '{name}' has shape "
                               f"{list(ref.shape_of(path))} there, {list(mine[name])} here ({_BUILT_OTHERWISE})")


def load_state(model, ref: IterationFile) -> None:
    """Overwrite the model's parameters and buffers with the reference's `state_before`, bit for bit (each value
    is cast to the live tensor's dtype and copied onto its device by `load_state_dict`). A sharded (FSDP2)
    parameter gets the reference's shard of this rank, copied into its own shard: no collective runs."""
    import torch

    check_structure(model, ref)
    state = {name: ref.tensor(path) for name, path in ref.state().items()}
    with torch.no_grad():  # by the model's own names, as load_state_dict copies (its hooks do not run: see names.py)
        for name, tensor, _ in state_tensors(model):
            shard_of(tensor).copy_(state[name]) if is_dtensor(tensor) else tensor.copy_(state[name])
