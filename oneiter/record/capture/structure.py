"""The shape of a module call's arguments and outputs: named tensor leaves, and a skeleton to refill them.

Where this sits: `hooks.py` names every tensor it records with `flatten` (`input.0`, `input.1.0`,
`kwarg.position_embeddings.1`, `output.logits`); the local-error probes (`probe.py`) rerun a call with the
reference's tensors in place of the live ones, which needs the call's structure without its live tensors: a
`Skeleton`. A skeleton keeps tuples, lists, dicts (and dict subclasses such as Hugging Face's `ModelOutput`),
non-tensor leaves as they were (None, ints, config objects), and a `Slot` (name, dtype, device, requires_grad,
shape, and its strides and storage offset when it was a non-contiguous view) where each tensor was. `fill`
builds the same structure again from a {name: tensor} mapping.

One tensor in several places of one call (`attn(h, h, h)`: nn.TransformerEncoderLayer hands its self-attention
query = key = value) is one tensor to the call: its code may test `query is key` (nn.MultiheadAttention then
projects all three with one matmul), and autograd gives it one gradient, the sum over the places it fills (what
the capture records for each of them). Every slot after the first of such a tensor names the first (`alias`),
and a rerun hands the call the same tensor there again.

A Hugging Face cache object passed to a call (anything with `update` and `get_seq_length` methods) is copied
when the skeleton is made: the call appends to it, and a rerun must see it as it was *before* the call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from oneiter.format.schema import kwarg_name
from oneiter.runtime.sharding import shard_of, spec_of

__all__ = ["flatten", "flatten_call", "Slot", "layout_of", "Skeleton", "skeleton", "skeleton_call", "fill", "is_cache",
           "snapshot"]


def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Yield (name, leaf) for nested tuples/lists/dicts: `output`, `output.0`, `output.logits`, `input.1.0`."""
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from flatten(item, f"{prefix}.{i}")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from flatten(item, f"{prefix}.{key}")
    else:
        yield prefix, obj


def flatten_call(args: Sequence[Any], kwargs: dict) -> Iterator[tuple[str, Any]]:
    """A call's arguments as named leaves: positional `input.<i>...`, keyword `kwarg.<name>...`."""
    yield from flatten(list(args), "input")
    for key, value in kwargs.items():
        yield from flatten(value, kwarg_name(key))


@dataclass(frozen=True)
class Slot:
    """Where a tensor was: its name and what a replacement must look like."""

    name: str
    dtype: Any
    device: Any
    requires_grad: bool
    shape: tuple
    layout: tuple | None = None  # (strides, storage offset) when the live tensor was not contiguous from offset 0
    alias: str | None = None  # the name of an earlier slot of the same call that held the very same tensor
    placed: tuple | None = None  # a DTensor's (mesh, placements, global shape, stride): its shard is what is stored


def layout_of(tensor) -> tuple | None:
    """(strides, storage offset) of a tensor that is not a contiguous block from the start of its storage (a
    transposed view, a slice into a larger buffer), else None: a rerun gives its input this layout back."""
    offset = tensor.storage_offset()
    if offset == 0 and tensor.is_contiguous():
        return None
    return tuple(tensor.stride()), int(offset)


def is_cache(value: Any) -> bool:
    """A Hugging Face KV cache (or anything shaped like one): mutated in place by the call it is passed to."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


class Skeleton:
    """A call's arguments (or its output) with every tensor replaced by a `Slot`."""

    def __init__(self, tree: Any, slots: list[Slot]):
        self.tree = tree
        self.slots = slots

    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def skeleton(obj: Any, prefix: str, *, snapshot_caches: bool = False, as_if_grad: bool = False,
             seen: dict[int, str] | None = None) -> Skeleton:
    """The skeleton of `obj` (a tuple of args: prefix `input`; an output: prefix `output`). `as_if_grad`: every
    floating tensor is taken to require a gradient (a reentrant checkpoint's region, run without gradients, whose
    recomputation differentiates it: `recompute.py`). `seen` (id of a tensor -> its first slot's name) is shared
    by the skeletons of one call's arguments: a tensor met again becomes an `alias` of its first slot."""
    import torch

    slots: list[Slot] = []
    seen = {} if seen is None else seen

    def walk(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            grad = value.requires_grad or (as_if_grad and value.is_floating_point())
            given, spec, value = value, spec_of(value), shard_of(value)  # a DTensor: its shard, and where it sits
            slot = Slot(name, value.dtype, value.device, bool(grad), tuple(value.shape),
                        None if value.layout != torch.strided else layout_of(value), seen.get(id(given)), spec)
            seen.setdefault(id(given), name)
            slots.append(slot)
            return slot
        if isinstance(value, (tuple, list)):
            items = [walk(v, f"{name}.{i}") for i, v in enumerate(value)]
            return _same_sequence(value, items)
        if isinstance(value, dict):
            return _same_dict(value, {k: walk(v, f"{name}.{k}") for k, v in value.items()})
        if snapshot_caches and is_cache(value):
            return snapshot(value)
        return value

    return Skeleton(walk(obj, prefix), slots)


def skeleton_call(args: tuple, kwargs: dict, *, as_if_grad: bool = False) -> tuple[Skeleton, Skeleton]:
    """Skeletons of a call's positional (`input...`) and keyword (`kwarg...`) arguments, caches snapshotted."""
    seen: dict[int, str] = {}
    pos = skeleton(list(args), "input", snapshot_caches=True, as_if_grad=as_if_grad, seen=seen)
    kw_slots: list[Slot] = []
    kw_tree = {}
    for key, value in kwargs.items():
        sk = skeleton(value, kwarg_name(key), snapshot_caches=True, as_if_grad=as_if_grad, seen=seen)
        kw_tree[key] = sk.tree
        kw_slots.extend(sk.slots)
    return pos, Skeleton(kw_tree, kw_slots)


def fill(sk: Skeleton, make: Callable[[Slot], Any]) -> Any:
    """The structure of `sk` with each Slot replaced by `make(slot)`; caches are copied again (a rerun mutates)."""

    def walk(value: Any) -> Any:
        if isinstance(value, Slot):
            return make(value)
        if isinstance(value, (tuple, list)):
            return _same_sequence(value, [walk(v) for v in value])
        if isinstance(value, dict):
            return _same_dict(value, {k: walk(v) for k, v in value.items()})
        if is_cache(value):
            return snapshot(value)
        return value

    return walk(sk.tree)


def snapshot(obj: Any) -> Any:
    """A deep copy of `obj` whose tensors are detached clones (tensors inside an autograd graph refuse deepcopy)."""
    import torch

    memo: dict[int, Any] = {}
    seen: set[int] = set()

    def collect(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 6:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            memo[id(value)] = value.detach().clone()
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                collect(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for item in vars(value).values():
                collect(item, depth + 1)

    collect(obj, 0)
    return copy.deepcopy(obj, memo)


def _same_sequence(original, items: list):
    if isinstance(original, list):
        return items
    if hasattr(original, "_fields"):  # namedtuple
        return type(original)(*items)
    try:
        return type(original)(items)
    except TypeError:
        return tuple(items)


def _same_dict(original: dict, items: dict) -> dict:
    """A dict of the same class (ModelOutput, OrderedDict...) holding `items`."""
    if type(original) is dict:
        return items
    try:
        new = copy.copy(original)
        for key, value in items.items():
            new[key] = value
        return new
    except Exception:  # a dict subclass that refuses copying or item assignment: a plain dict still flattens alike
        return dict(items)
