"""The moment right before an optimizer changes the weights, whether or not its step runs a closure.

`optimizer.step()` without a closure updates the weights at once: a step pre-hook runs right before. With a closure
(`optimizer.step(closure)`: PyTorch Lightning's automatic optimization, `LBFGS`, accelerate's wrapper passing one
on), the step *first calls the closure*, and the closure runs the forward, the loss and the backward: the pre-hook
fires before the batch has even been seen. `before_update` hides the difference: it calls `fn()` in the pre-hook
of a plain step, and after the closure returns (once per step) in a closure step, so `fn` always sees this step's
gradients and the weights they are about to update.

Where it sits: the Recorder (gradients read, the optimizer's update judged), the multi-step signature (gradient
norms, the weights before the update) and the twin (its weights put back before the update) all register here.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["before_update"]


def before_update(optimizer, fn: Callable[[], None]):
    """Call `fn()` right before each step of `optimizer` updates the weights; returns the hook's handle (`.remove()`).

    The step pre-hook receives `(optimizer, args, kwargs)` with `args[0]` the optimizer itself; a closure is the
    keyword `closure` or the first positional argument after it (torch's `step(closure=None)`)."""

    def pre_hook(_opt, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if not callable(closure):
            fn()
            return None
        ran: list[bool] = []

        def closure_then_fn() -> Any:
            result = closure()
            if not ran:  # LBFGS calls the closure again and again: the step's gradients are those of the first
                ran.append(True)
                fn()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_fn}
        return (args[0], closure_then_fn, *args[2:]), kwargs

    return optimizer.register_step_pre_hook(pre_hook)
