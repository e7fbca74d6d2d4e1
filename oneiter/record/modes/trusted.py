"""Whether the code running now is a *trusted recomputation*, and the kernels such a recomputation runs.

Where this sits: the local-error probes (`record/local/probe.py`) recompute module calls to calibrate the expected
noise of a precision (on the CPU, in float64 and in the run's precision) or, with `--against cpu`, to get a float32
reference; the op drill-down (`record/replay/op_rerun.py`) reruns single ops the same way. Those recomputations run
the model's own Python code — a wrapped `forward`, a patched class, a replaced torch function are all part of it, on
purpose — but not what stands for the *device*: oneiter's own faults (`--inject-fault`, `record/modes/faults.py`)
and `--fallback` check `active()` and step aside.

**Kernels.** A calibration that runs a wrong kernel measures that kernel's error as noise. So inside `running()`,
every op whose CPU kernel is not torch's own (`runtime/kernels.py` asks the dispatcher: a `torch.library`
registration, a C++ extension's kernel over torch's) runs another way, chosen per op (`route`), the first that
applies:
1. `sibling`: torch's own CPU kernel of another overload of the op, the same computation (`aten::silu.out` for
   `aten::silu`, the functional op for an out= or in-place one): bit for bit torch's kernel;
2. `composite`: torch's own composite kernel of the op (`CompositeExplicitAutograd...`), redispatched to;
3. `decomposition`: torch's decomposition of the op (`torch._decomp`) into other ops (themselves routed);
4. `float64`: the op's own kernel in float64, its inputs perturbed at the op's precision (the accumulation of
   its reduction: `runtime/roundoff.py`) and its results rounded to the op's dtype — the noise then does not
   depend on the kernel's float32 (or bf16) path; a call already in float64, or an op without a float64 kernel,
   runs its own kernel as it is (there is no other).
A replaced backward formula (an `AutogradCPU` registration) runs above any dispatch mode and is not routed (its
report says so). Ops whose kernels are torch's own are left alone; with none replaced the recomputation runs with no
mode at all. `routes()` says, for each replaced op, where it was registered and which route it takes: what the
recordings and reports state. Test stand-ins for plugins (tests/model_files/faulty_kernels.py, tf32kit.py) register
their kernels this way and know nothing of oneiter.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch._decomp import decomposition_table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from oneiter.runtime import kernels
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.roundoff import inject, meta_outputs

__all__ = ["active", "running", "paused", "routes", "Route", "route_for", "TrustedKernels", "SEED", "mark", "met_since",
           "met_kernels"]

SEED = 0x7255  # the float64 route's perturbation signs come from a generator seeded with this, per recomputation
_COMPOSITES = ("CompositeExplicitAutogradNonFunctional", "CompositeExplicitAutograd", "CompositeImplicitAutograd")

_state = threading.local()
_met: dict[str, int] = {}  # op name -> the latest mark when a trusted recomputation last routed it
_marks = [0]


def mark() -> int:
    """A new mark: `met_since(mark)` names the replaced ops trusted recomputations route from now on."""
    _marks[0] += 1
    return _marks[0]


def met_since(since: int) -> set[str]:
    """The replaced ops (`aten::silu`) a trusted recomputation routed since `mark()` gave `since`."""
    return {op for op, at in _met.items() if at >= since}


def active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextmanager
def running(enabled: bool = True) -> Iterator[None]:
    """Mark the block as a trusted recomputation (no-op when `enabled` is False): oneiter's faults and fallback step
    aside, and ops whose CPU kernels are not torch's own take their route (module docstring)."""
    if not enabled:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        replaced = [f for f in kernels.foreign("cpu") if not f.autograd]
        if replaced:
            with TrustedKernels(replaced):
                yield
        else:
            yield
    finally:
        _state.depth -= 1


@contextmanager
def paused() -> Iterator[None]:
    """The block is the run's own code again, inside a trusted recomputation (`record --impact`: the children of a
    fixed call run as they ran live): oneiter's faults and fallback apply there. The caller takes the routing mode
    off the dispatch stack itself (`_disable_current_modes`)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = 0
    try:
        yield
    finally:
        _state.depth = depth


@dataclass(frozen=True)
class Route:
    """How a trusted recomputation runs an op whose CPU kernel is not torch's own."""

    kind: str
    """`sibling`, `composite`, `decomposition`, `float64`, or `none` (a backward formula: not routed)."""
    label: str
    """In words, for reports: `torch's CPU kernel of aten::silu.out`."""
    target: Any = None


def routes(device_type: str = "cpu") -> list[tuple[kernels.Foreign, Route]]:
    """Each op whose kernel on `device_type` is not torch's own, with the route a trusted (CPU) recomputation takes
    (for a device other than the CPU: what its own calibration cannot replace, `none`)."""
    found = []
    for entry in kernels.foreign(device_type):
        if entry.autograd:
            route = Route("none", f"not replaced: its backward formula ({entry.key}), which is not torch's, runs "
                                  f"in the calibration too")
        elif device_type != "cpu":
            route = Route("none", "the device's own kernel (its noise is checked against the CPU's)")
        else:
            func = kernels.op_named(entry.op)
            route = route_for(func) if func is not None else Route("float64", _FLOAT64)
        found.append((entry, route))
    return found


def met_kernels(since: int) -> list[dict]:
    """The replaced CPU kernels trusted recomputations met since `mark()` gave `since`, each with where it was
    registered and its route (and aten ops whose backward formula was replaced: no recomputation can route those),
    as recordings store them (`format.schema.FOREIGN_KERNELS`)."""
    met = met_since(since)
    return [{"op": f.op, "key": f.key, "registered": f.registered, "route": route.label, "kind": route.kind}
            for f, route in routes("cpu") if f.op in met or (route.kind == "none" and f.op.startswith("aten::"))]


_FLOAT64 = ("its own kernel in float64, its inputs perturbed at the op's precision and its result rounded to its "
            "dtype (no kernel of torch's stands for it)")


def route_for(func) -> Route:
    """The route of an op whose CPU kernel is not torch's own (module docstring), as the registrations and torch's
    decompositions are now (each trusted recomputation decides it once per op)."""
    sibling = _sibling(func)
    if sibling is not None:
        return Route("sibling", f"torch's CPU kernel of {sibling.name()}", sibling)
    name = func.name()
    for key in _COMPOSITES:
        where = kernels.alias_registered_at(name, key)
        if where is not None and kernels.own_registration(where, name):
            return Route("composite", f"torch's {key} kernel",
                         torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)))
    decomposition = decomposition_table.get(func)
    if decomposition is not None:
        return Route("decomposition", "torch's decomposition (torch._decomp) into other ops", decomposition)
    return Route("float64", _FLOAT64)


def _own_cpu(op) -> bool:
    """Whether the op has a CPU kernel of its own (not a composite, which may call the replaced op back) and it is
    torch's."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"):
        return False
    where = kernels.registered_at(op.name(), "CPU")
    return where is not None and kernels.own_registration(where, op.name())


def _inputs(schema) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]


def _sibling(func):
    """Another overload of the op computing the same thing, whose CPU kernel is torch's own: the out= variant of a
    functional op, the functional op of an out= variant, the functional op of an in-place one (`silu_` -> `silu`)."""
    schema = func._schema
    packet = func.overloadpacket
    outs = [a for a in schema.arguments if a.is_out]
    if schema.is_mutable and not outs:  # in place: `silu_` -> `silu`, same overload
        name = packet.__name__
        functional = getattr(getattr(torch.ops, func.namespace), name[:-1], None) if name.endswith("_") else None
        candidate = getattr(functional, func._overloadname, None) if functional is not None else None
        if candidate is not None and _inputs(candidate._schema) == _inputs(schema) and _own_cpu(candidate):
            return candidate
        return None
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if candidate is func or _inputs(candidate._schema) != _inputs(schema):
            continue
        theirs = [a for a in candidate._schema.arguments if a.is_out]
        fits = (not theirs and not candidate._schema.is_mutable) if outs else len(theirs) == len(schema.returns)
        if fits and _own_cpu(candidate):
            return candidate
    return None


class TrustedKernels(TorchDispatchMode):
    """Runs the replaced ops by their routes (module docstring). `used`: op name -> route label, of those it met."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # an eager-only mode

    def __init__(self, replaced):
        super().__init__()
        self.replaced = {kernels.op_named(f.op): f for f in replaced}
        self.replaced.pop(None, None)
        self.used: dict[str, str] = {}
        self._routes: dict = {}
        self._inside: set = set()  # ops whose route is running
        self._rng = np.random.default_rng(SEED)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.replaced:
            return func(*args, **kwargs)
        if func in self._inside:  # its route calls the op back (a decomposition of one case into another)
            return self._float64(func, args, kwargs)
        route = self._routes.get(func)
        if route is None:
            route = self._routes[func] = route_for(func)
        self.used[func.name()] = route.label
        _met[func.name()] = _marks[0]
        self._inside.add(func)
        try:
            if route.kind == "float64":
                return self._float64(func, args, kwargs)
            with self:  # what the route dispatches is routed too
                return _RUNNERS[route.kind](route.target, func, args, kwargs)
        finally:
            self._inside.discard(func)

    def _float64(self, func, args: tuple, kwargs: dict):
        """The op's own kernel in float64 on inputs perturbed at its precision, results rounded back."""
        floats = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats or all(t.dtype == torch.float64 for t in floats):
            return func(*args, **kwargs)
        like = meta_outputs(func, args, kwargs)
        dtypes = [t.dtype for t in like] if like else [floats[0].dtype]
        u = max(unit_roundoff(str(d)) for d in dtypes if d.is_floating_point) if any(
            d.is_floating_point for d in dtypes) else unit_roundoff(str(floats[0].dtype))
        wide = tree_map(_widened, (args, kwargs))
        wide = inject(func, wide[0], wide[1], u, min(u, unit_roundoff("float32")), self._rng)
        try:
            result = func(*wide[0], **wide[1])
        except Exception:  # noqa: BLE001 - no float64 kernel either: the op's own kernel as it is, the only one
            return func(*args, **kwargs)
        produced = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if len(dtypes) != len(produced):
            dtypes = [floats[0].dtype] * len(produced)
        narrowed = [value.to(dtype) if value.is_floating_point() else value
                    for value, dtype in zip(produced, dtypes, strict=True)]
        return _write_back(func, args, kwargs, narrowed)


def _widened(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch.float64)
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    return x


def _write_back(func, args: tuple, kwargs: dict, values: list):
    """The op's results as it returns them: fresh tensors, or written into its out= or in-place arguments."""
    schema = func._schema
    outs = [kwargs[a.name] for a in schema.arguments if a.is_out and a.name in kwargs]
    if not outs and schema.is_mutable and args:
        outs = [args[0]]
    if outs:
        for target, value in zip(outs, values, strict=False):
            if tuple(target.shape) != tuple(value.shape):
                target.resize_(value.shape)
            target.copy_(value)
        return outs[0] if len(schema.returns) == 1 else tuple(outs)
    return values[0] if len(schema.returns) == 1 else tuple(values)


def _run_sibling(sibling, func, args: tuple, kwargs: dict):
    schema = func._schema
    if any(a.is_out for a in schema.arguments) or schema.is_mutable:  # out= or in place: the functional op
        names = {a.name for a in schema.arguments if a.is_out}
        result = sibling(*args, **{k: v for k, v in kwargs.items() if k not in names})
        values = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        return _write_back(func, args, kwargs, values)
    like = meta_outputs(func, args, kwargs, keep_none=True)
    if like is None:
        raise RuntimeError(f"{func.name()}: no meta kernel to size the outputs of {sibling.name()}")
    device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    buffers = [torch.empty(0, device=device) if m is None else
               torch.empty_strided(tuple(m.shape), tuple(m.stride()), dtype=m.dtype, device=device) for m in like]
    outs = [a.name for a in sibling._schema.arguments if a.is_out]
    result = sibling(*args, **kwargs, **dict(zip(outs, buffers, strict=True)))
    if not isinstance(result, (tuple, list)):
        return result
    return tuple(None if m is None else r for m, r in zip(like, result, strict=True))  # outputs it did not compute


def _run_composite(keyset, func, args: tuple, kwargs: dict):
    return func.redispatch(keyset, *args, **kwargs)


def _run_decomposition(decomposition, func, args: tuple, kwargs: dict):
    return decomposition(*args, **kwargs)


_RUNNERS: dict[str, Callable] = {"sibling": _run_sibling, "composite": _run_composite,
                                 "decomposition": _run_decomposition}
