"""State carried between two calls of one iteration: a call that starts from a tensor an earlier call left on a module.

A module called twice whose second call continues the first's recurrence (the first leaves its final state as a
plain attribute, `self.state`, and the second starts from it) passes a tensor of the graph from one call to the next
outside any argument. Its gradient reaches the first call through the attribute, no output of it: a rerun of the
first call alone cannot seed it, so its backward (and its parameters' gradients) would be judged without that part
(a variant of `tests/model_files/stateful.py` calling its scan twice: `block.scan@0 backward grad_input.0`, millions
of times its noise, on a clean replay). Neither call is probed alone then: both run live inside their caller's rerun,
which starts from the attributes as the caller found them and so carries the state from one to the other as the live
iteration did; the caller is judged with their code (`culprit_includes`). The first call's forward rows stand (its
forward is judged from the reference's inputs and its own start state).

`CarriedState` remembers what each call left (`CallRecord.left`, from `runtime/module_state.left`) and tells, when a
call returns, whether it started from one of those tensors (the same storage in the same attribute of the same
module), and from which call. Where this sits: the probe asks it in `after_call` (`probe.py`).
"""

from __future__ import annotations

from typing import Any, Optional

from oneiter.runtime.module_state import address

__all__ = ["CarriedState"]


class CarriedState:
    """What the calls so far left in their modules' attributes, and who left it."""

    def __init__(self) -> None:
        self._left: dict[tuple[int, str], tuple[int, Any]] = {}  # (id(module), attribute) -> (address, the call)

    def started_from(self, rec) -> Optional[tuple[Any, str]]:
        """(the earlier call, the attribute's path) when `rec` began with a tensor an earlier call left; else None."""
        paths = None
        for mod, then in rec.attributes or ():
            for name, value in then.items():
                hit = self._left.get((id(mod), name))
                if hit is None or hit[1] is rec or address(value) != hit[0]:
                    continue
                if paths is None:
                    paths = {id(m): p for p, m in rec.module.named_modules()}
                prefix = ".".join(p for p in (rec.path, paths.get(id(mod), "")) if p)
                return hit[1], f"{prefix}.{name}" if prefix else name
        return None

    def leaving(self, rec) -> None:
        """`rec` returned: what it left is where a later call may start."""
        for key, at in rec.left.items():
            self._left[key] = (at, rec)
