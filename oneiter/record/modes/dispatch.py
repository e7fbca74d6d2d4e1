"""What every oneiter dispatch mode active around the model's own code shares, compiled code included.

Where this sits: the base of the modes the Recorder keeps on while the iteration runs (`randomness.py`'s random
recorder and replayer, `collectives.py`'s recorder and its forcer in reruns). Compiled code (torch.compile) runs
under them, and three things then reach a mode that eager code never sends it:

- **it must let compiled code run compiled** (`ignore_compile_internals`): torch.compile runs a model eagerly while a
  mode that says otherwise is active (measured, torch 2.13): a replay must run the target's compiled code;
- **the compiler's own work**: a backend may compile lazily, when a graph first runs — DDP's graph splitter
  (`DDPOptimizer`) compiles each piece then, and inductor with `fallback_random` traces its patterns then — and
  its tracing (`make_fx`, fake tensors) dispatches ops through whatever modes are active. Those ops are no part of
  the iteration (`torch.randperm` of a pattern is no random op of the model, and reading the generator's state of
  a fake tensor fails): while a fake or proxy mode is active, `compiling` says so and the mode passes the op on;
- **higher-order operators** (`run_and_save_rng_state` and `run_with_rng_state`, which compiled activation
  checkpointing wraps around its random ops; `invoke_subgraph`): torch hands them to a mode that says it
  `supports_higher_order_operators`, and raises for one that does not. `run_higher_order` runs such an operator by
  its dense implementation with the mode active again, so the aten ops inside it come through the mode like any
  other (a dropout inside `run_and_save_rng_state` is replayed, and its recomputation under `run_with_rng_state`,
  from the state saved, is recognised as the same draw). One without a dense implementation is an error of oneiter,
  never of the model.

An exception raised by a mode's own logic is oneiter's (exit 3); only the op the mode runs for the model
(`func(*args, **kwargs)` in its `__torch_dispatch__`) can raise the model's own error (`errors.user_frame`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oneiter.runtime.compiled import skip_dispatch

__all__ = ["IterationMode", "compiling", "is_higher_order"]


def compiling() -> bool:
    """Whether the op being dispatched is a compiler tracing its own code (a fake or proxy mode is active), not the
    model's computation."""
    key = torch._C._TorchDispatchModeKey
    return torch._C._get_dispatch_mode(key.FAKE) is not None or torch._C._get_dispatch_mode(key.PROXY) is not None


def is_higher_order(func) -> bool:
    return isinstance(func, torch._ops.HigherOrderOperator)


def _dense_kernel(hop):
    from torch._C import DispatchKey

    for key in (DispatchKey.CompositeExplicitAutograd, DispatchKey.BackendSelect):
        kernel = hop.py_kernels.get(key)
        if kernel is not None:
            return kernel
    return None


class IterationMode(TorchDispatchMode):
    """A dispatch mode active while the model's (possibly compiled) code runs: module docstring. A subclass's
    `__torch_dispatch__` starts with

        if is_higher_order(func) or compiling():
            return self.pass_on(func, args, kwargs)
    """

    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in torch._dynamo.disable unless this says no: that imports dynamo (~4 s) on
        # the first op and adds a wrapper to every op. These modes only ever run in eager mode (`skip_dispatch`)
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code runs compiled under these modes (module docstring)

    def __enter__(self):
        skip_dispatch(self)  # with compiled code about: this mode's Python is never compiled
        return super().__enter__()

    def pass_on(self, func, args: tuple, kwargs: dict):
        """A higher-order operator run with this mode active inside it, or a compiler's own op run as it is."""
        if is_higher_order(func) and not compiling():
            return self.run_higher_order(func, args, kwargs)
        return func(*args, **kwargs)

    def run_higher_order(self, hop, args: tuple, kwargs: dict):
        kernel = _dense_kernel(hop)
        if kernel is None:
            raise NotImplementedError(f"oneiter's {type(self).__name__} cannot run the higher-order operator "
                                      f"{hop.name()} (no dense implementation to run its ops through)")
        TorchDispatchMode.__enter__(self)  # torch took this mode off the stack for the call: back on, for the ops
        try:  # inside (the subclass's own __enter__/__exit__ would begin and end its recording)
            return kernel(*args, **kwargs)
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)
