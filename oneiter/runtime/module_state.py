"""The tensors a module keeps in plain attributes (neither parameters nor buffers) from one call to the next.

Model code keeps state this way: Hugging Face's RecurrentGemma RG-LRU leaves its final recurrent state as
`self.recurrent_states` and starts its next call from it (its caller sets it to None or to zeros first, or not).
What a call computes then depends on those attributes as the call found them, and after the call they hold the
call's *end* state, a tensor of the live graph. A rerun of the call (`record/local/rerun.py`) must start from the
attributes as the live call found them, not from what it left: a rerun started from the live end state computes
from another state, and its backward runs on into the live graph and frees the tensors the real backward needs
(torch's "Trying to backward through the graph a second time"). And the rerun must leave them as the live call left
them: the model's next call starts from those.

A call may also start from a tensor *an earlier call of the same iteration* left (a module called twice, its second
call continuing the first's recurrence): that tensor's gradient reaches the first call through the attribute, no
output of it, which no rerun of the first call can seed. `left(saved)` says what a call left (each tensor attribute
that is not what it found), so the probe can tell such a pair of calls (`record/local/carried.py`).

`state(module)` is taken when a call begins (`record/capture/hooks.py`, for `module` and every module under it: the
call's code may read or set its children's attributes); `started(saved)` puts the attributes that hold a tensor
back where the call found them for the length of a rerun, each tensor a fresh copy, detached (nothing the rerun
computes or writes in place reaches the live one), and restores what it found afterwards. Limits: a tensor the live
call changed in place after it began holds its changed values (`state` keeps no copy of the values); tensors inside
an attribute's container (a list, a dict, a cache object) are not attributes and are left as they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["state", "started", "left", "address"]

_ABSENT = object()


def state(module) -> list[tuple[Any, dict]]:
    """(module, its instance attributes) for `module` and every module under it, as they are now; a tensor detached:
    its values, not the graph that made it (which the saved state would otherwise keep alive)."""
    import torch  # not at import: `import oneiter` imports no torch (tests/record/test_api.py)

    return [(mod, {name: value.detach() if isinstance(value, torch.Tensor) else value
                   for name, value in vars(mod).items()})
            for mod in module.modules()]


@contextmanager
def started(saved: list[tuple[Any, dict]] | None) -> Iterator[None]:
    """Within: every attribute of the modules in `saved` that holds a tensor now or held one in `saved` is as `saved`
    has it (a tensor as a fresh detached copy; an attribute `saved` does not have is removed); afterwards, each is
    what it was found to be (and a tensor attribute made meanwhile is removed). `saved` None: nothing is changed."""
    import torch

    found: list[tuple[dict, dict]] = []  # (a module's instance dict, {name: what it held when found})
    try:
        for mod, then in saved or ():
            own = vars(mod)
            names = {n for n, v in own.items() if isinstance(v, torch.Tensor)}
            names |= {n for n, v in then.items() if isinstance(v, torch.Tensor)}
            found.append((own, {n: own.get(n, _ABSENT) for n in names}))
            for name in names:
                _put(own, name, _fresh(then.get(name, _ABSENT)))
        yield
    finally:
        for own, held in found:
            for name in [n for n, v in own.items() if isinstance(v, torch.Tensor) and n not in held]:
                del own[name]
            for name, value in held.items():
                _put(own, name, value)


def left(saved: list[tuple[Any, dict]] | None) -> dict[tuple[int, str], int]:
    """(id(module), attribute) -> storage address of each tensor attribute of the modules in `saved` (taken when a
    call began) that is a tensor of the graph (it requires a gradient) and not the tensor `saved` holds there: what
    the call left for a later call, with a gradient to come through it. A cache no gradient flows through (a rotary
    table kept as an attribute) and a tensor without storage (a meta tensor) are left out."""
    import torch

    found = {}
    for mod, then in saved or ():
        for name, value in vars(mod).items():
            if not isinstance(value, torch.Tensor) or not value.requires_grad:
                continue
            before = then.get(name)
            at = address(value)
            if at is not None and not (isinstance(before, torch.Tensor) and address(before) == at):
                found[(id(mod), name)] = at
    return found


def address(value) -> int | None:
    """Where a tensor's data starts (a detached copy of the reference shares it); None for anything else, or a
    tensor without storage."""
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    try:
        return int(value.data_ptr())
    except RuntimeError:  # no storage (a meta tensor)
        return None


def _fresh(value):
    """A tensor's copy, outside any graph; anything else as it is."""
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    with torch.no_grad():
        return value.detach().clone()


def _put(own: dict, name: str, value) -> None:
    if value is _ABSENT:
        own.pop(name, None)
    else:
        own[name] = value
