"""The model's batch as a framework delivers it: name its tensors, store them, swap in a reference's.

Where it sits: the mmengine record hook calls `map_tensors` in a forward pre-hook on the model, once to store the
batch (`store_batch`) and, with `replay=`, once before that to put the reference's tensors in place
(`BatchSwap`).

Names follow `record/capture/hooks.py`: positional arguments `input.<i>`, keyword arguments `kwarg.<name>`, nested
containers add `.<index>` / `.<key>`, and data fields of mmengine data elements add `.<field>`
(`kwarg.data_samples.0.gt_label`). In the file, tensor number n of the batch is `batch/input.<n>` (numbered, as
`IterationFile.batch_paths` expects) and its name is the dataset attribute `arg`. A recording made by
`oneiter record` has no `arg` attribute: its batch names are `input.<i>`, positional arguments. An iteration of
several microbatches numbers every microbatch's tensors on (`input.<n>`), each after the first with the attribute
`microbatch` (docs/format.md "Microbatches"); `read_batch` reads one microbatch's.
"""

from __future__ import annotations

from typing import Any, Callable

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import BATCH, MICROBATCH, arg_name, kwarg_name

__all__ = ["map_tensors", "map_call", "store_batch", "batch_rows", "read_batch", "BatchSwap"]

_MAX_DEPTH = 8


def _data_element_type():
    try:
        from mmengine.structures import BaseDataElement
    except ImportError:  # the helpers work without mmengine; there are then no data elements to look into
        return None
    return BaseDataElement


def map_tensors(obj: Any, prefix: str, fn: Callable[[str, Any], Any], depth: int = 0) -> Any:
    """`obj` with each tensor leaf replaced by `fn(name, tensor)`.

    Containers are rebuilt only when a leaf changed, so `fn` returning its argument leaves `obj` untouched. Data
    fields of mmengine data elements are replaced in place (the element is the one this batch just made).
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(prefix, obj)
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, (list, tuple)):
        return _map_sequence(obj, prefix, fn, depth)
    if isinstance(obj, dict):
        return _map_dict(obj, prefix, fn, depth)
    element = _data_element_type()
    if element is not None and isinstance(obj, element):
        _map_data_element(obj, prefix, fn, depth)
    return obj


def _map_sequence(obj: list | tuple, prefix: str, fn: Callable[[str, Any], Any], depth: int) -> Any:
    """A list or tuple (a namedtuple keeps its type), rebuilt only when a leaf changed."""
    items = [map_tensors(v, f"{prefix}.{i}", fn, depth + 1) for i, v in enumerate(obj)]
    if all(new is old for new, old in zip(items, obj, strict=True)):  # `items` has one per element of `obj`
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*items)
    return type(obj)(items)


def _map_dict(obj: dict, prefix: str, fn: Callable[[str, Any], Any], depth: int) -> Any:
    """A dict (its own type where its constructor takes one), rebuilt only when a value changed."""
    items = {k: map_tensors(v, f"{prefix}.{k}", fn, depth + 1) for k, v in obj.items()}
    if all(items[k] is obj[k] for k in obj):
        return obj
    try:
        return type(obj)(items)
    except TypeError:  # a dict subclass with another constructor (defaultdict)
        return dict(items)


def _map_data_element(obj: Any, prefix: str, fn: Callable[[str, Any], Any], depth: int) -> None:
    """Replace the changed data fields of an mmengine data element in place."""
    for key in list(obj.keys()):
        value = getattr(obj, key)
        new = map_tensors(value, f"{prefix}.{key}", fn, depth + 1)
        if new is not value:
            setattr(obj, key, new)


def map_call(args: tuple, kwargs: dict, fn: Callable[[str, Any], Any]) -> tuple[tuple, dict]:
    """`map_tensors` over a call's arguments: `input.<i>` for positional, `kwarg.<name>` for keyword ones."""
    new_args = tuple(map_tensors(a, arg_name(i), fn) for i, a in enumerate(args))
    new_kwargs = {k: map_tensors(v, kwarg_name(k), fn) for k, v in kwargs.items()}
    return new_args, new_kwargs


def store_batch(sink, args: tuple, kwargs: dict, *, start: int = 0, microbatch: int = 0) -> int:
    """Queue every tensor of the call as `batch/input.<n>` (n from `start` on) with its name in attribute `arg`, and
    `microbatch` when it is not the first; returns how many were stored."""
    count = 0
    attrs = {MICROBATCH: microbatch} if microbatch else {}

    def put(name: str, tensor):
        nonlocal count
        # never a link: the same tensor passed twice (`model(input_ids=ids, labels=ids)`) is two batch entries,
        # each with its own name (a link would share the first one's `arg`)
        sink.put(BATCH, arg_name(start + count), tensor, {"arg": name, **attrs}, dedup=False)
        count += 1
        return tensor

    map_call(args, kwargs, put)
    return count


def batch_rows(args: tuple, kwargs: dict) -> int:
    """The leading dimension of the call's first tensor of at least one dimension (0 when there is none): the
    batch size, as far as the arguments tell."""
    found: list[int] = []

    def first(_name: str, tensor):
        if not found and tensor.dim() > 0:
            found.append(int(tensor.shape[0]))
        return tensor

    map_call(args, kwargs, first)
    return found[0] if found else 0


def read_batch(ref: IterationFile, microbatch: int = 0) -> dict[str, Any]:
    """The reference's batch tensors of one microbatch by name (`kwarg.inputs`, `input.0`...), on the CPU, bit for
    bit."""
    batch = {}
    for path in ref.batch_paths(microbatch):
        name = ref.attrs(path).get("arg") or path.rpartition("/")[2]
        batch[str(name)] = ref.tensor(path)
    return batch


class BatchSwap:
    """A `map_tensors` function handing out the reference's tensor of the same name, shape-checked.

    The tensor is moved to the live tensor's device and cast to its dtype (a no-op when both runs use the same
    precision); `check_complete()` fails if the reference holds a tensor this batch does not have.
    """

    def __init__(self, batch: dict[str, Any], source: str, microbatch: int | None = None):
        self.batch = batch
        self.source = source
        self.used: set[str] = set()
        # in the errors, which microbatch's batch (None: the iteration has one)
        self.where = "" if microbatch is None else f" of microbatch {microbatch}"

    def __call__(self, name: str, live):
        theirs = self.batch.get(name)
        if theirs is None:
            raise OneIterError(
                f"the reference '{self.source}' has no batch tensor '{name}'{self.where} "
                f"(it has: {', '.join(self.batch) or 'none'}); replay a recording of the same model and data pipeline"
            )
        if tuple(theirs.shape) != tuple(live.shape):
            raise OneIterError(
                f"batch tensor '{name}'{self.where} has shape {list(theirs.shape)} in the reference '{self.source}', "
                f"{list(live.shape)} here (same batch size and input size as the reference?)"
            )
        self.used.add(name)
        swapped = theirs.to(device=live.device, dtype=live.dtype)
        return swapped.requires_grad_() if live.requires_grad else swapped

    def check_complete(self) -> None:
        missing = [name for name in self.batch if name not in self.used]
        if missing:
            raise OneIterError(
                f"the reference '{self.source}' has batch tensors{self.where} this model's batch does not: "
                f"{', '.join(missing)}"
            )
