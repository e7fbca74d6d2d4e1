"""The names a model's parameters and buffers have in a recording: one walk of the module tree, one rule.

A tensor's name is its module path and attribute (`layers.0.attention.qkv_linear.wqkv.weight`), as
`named_parameters` gives it, with two differences that make a recording's names the model's own:

- **never `state_dict` names**: a module's state_dict hooks may rename, split or merge tensors when the model is
  saved (torchtitan's fused QKV keeps one parameter, `wqkv`, and saves it as three new tensors `wq`, `wk`, `wv`
  that are no parameter), so the names a module's hooks, its gradients and its optimizer see are not there. The
  walk below reads each module's own `_parameters` and `_buffers`, in `state_dict`'s order (a module's parameters,
  then its persistent buffers, then its children), and leaves out the non-persistent buffers, as `state_dict` does;
- **wrappers add no level** (`canonical`): torch.compile's `OptimizedModule` holds the model as `_orig_mod`,
  activation checkpointing's `CheckpointWrapper` as `_checkpoint_wrapped_module`, FSDP1 as
  `_fsdp_wrapped_module`; those segments are dropped, so a compiled or wrapped model has the names of the model it
  wraps (what the wrappers' own state_dict hooks do for the last two).

Torch-free: it reads module attributes only (`oneiter.Recorder` loads without torch).
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["WRAPPER_SEGMENTS", "canonical", "state_tensors", "parameters", "tensor_names", "module_paths"]

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    """`name` (a module path or a tensor name) without the wrapper segments (`_orig_mod.layers.0.weight` ->
    `layers.0.weight`)."""
    if not any(segment in name for segment in WRAPPER_SEGMENTS):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def module_paths(model) -> Iterator[tuple[str, Any]]:
    """(canonical path, module) of every module, as `named_modules()` walks them (each module once)."""
    for path, module in model.named_modules():
        yield canonical(path), module


def state_tensors(model) -> list[tuple[str, Any, bool]]:
    """(canonical name, tensor, is_parameter) of everything `state_dict` would hold, without running its hooks: per
    module in state_dict's order its parameters, then its persistent buffers. A tensor shared by two modules (tied
    weights) is listed under each name, as state_dict lists it."""
    found: list[tuple[str, Any, bool]] = []

    def walk(module, prefix: str) -> None:
        for name, param in module._parameters.items():
            if param is not None:
                found.append((canonical(prefix + name), param, True))
        skipped = getattr(module, "_non_persistent_buffers_set", ())
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in skipped:
                found.append((canonical(prefix + name), buffer, False))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    walk(model, "")
    return found


def parameters(model) -> list[tuple[str, Any]]:
    """(canonical name, parameter) of each parameter once, as `named_parameters()` gives them."""
    return [(canonical(name), param) for name, param in model.named_parameters()]


def tensor_names(model) -> dict[int, str]:
    """id of every parameter and buffer (non-persistent ones too) -> its canonical name (the first, for a tensor
    held under several)."""
    names = {id(b): canonical(n) for n, b in model.named_buffers()}
    names.update({id(p): canonical(n) for n, p in model.named_parameters()})
    return names
