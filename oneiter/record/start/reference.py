"""`record --replay`: start the target from the reference's initial weights, buffers and batch.

The model is still built from its spec (so closures such as the loss's labels are rebuilt with the reference's
seed), then its state and inputs are overwritten with the reference's bits after a structure check that names
the first mismatching parameter or shape.
"""

from __future__ import annotations

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.runtime.compiled import eager_name
from oneiter.runtime.sharding import is_dtensor, local

__all__ = ["check_structure", "load_state", "load_reference"]


def check_structure(model, ref: IterationFile) -> None:
    """Raise OneIterError naming the first parameter/buffer whose name or shape differs from the reference (a
    sharded parameter's shape is this rank's shard's: what the rank's file holds)."""
    mine = {eager_name(name): tuple(local(t).shape) for name, t in model.state_dict().items()}
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


def load_state(model, ref: IterationFile) -> None:
    """Overwrite the model's parameters and buffers with the reference's `state_before`, bit for bit (each value
    is cast to the live tensor's dtype and copied onto its device by `load_state_dict`). A sharded (FSDP2)
    parameter gets the reference's shard of this rank, copied into its own shard: no collective runs."""
    import torch

    check_structure(model, ref)
    live = model.state_dict(keep_vars=True)
    paths = ref.state()
    # by the model's own names (a compiled model's hold `_orig_mod`): the reference holds the eager model's
    state = {name: ref.tensor(paths[eager_name(name)]) for name in live if eager_name(name) in paths}
    sharded = [name for name, tensor in live.items() if is_dtensor(tensor)]
    with torch.no_grad():
        for name in sharded:
            local(live[name]).copy_(state.pop(name))
        if not sharded:
            model.load_state_dict(state, strict=True)
            return
        for name, value in state.items():  # the unsharded rest (buffers), as load_state_dict would copy them
            live[name].copy_(value)


def load_reference(bundle, ref: IterationFile) -> None:
    """Overwrite the bundle's model state and inputs with the reference's, bit for bit (`oneiter replay`)."""
    load_state(bundle.model, ref)
    batch = [ref.tensor(p) for p in ref.batch_paths()]
    if len(batch) != len(bundle.inputs):
        raise OneIterError(f"the reference has {len(batch)} model inputs, this model takes {len(bundle.inputs)}")
    for i, (mine, theirs) in enumerate(zip(bundle.inputs, batch, strict=True)):
        if tuple(mine.shape) != tuple(theirs.shape):
            raise OneIterError(
                f"input {i} has shape {list(theirs.shape)} in the reference, {list(mine.shape)} here "
                f"(same batch size and model arguments as the reference?)"
            )
    bundle.inputs = tuple(batch)
