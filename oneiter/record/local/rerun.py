"""Rerunning one recorded module call, with its children forced, at a chosen place and precision.

Where this sits: `probe.py` decides what to rerun and judges the results; this module does one rerun. A rerun of
call C takes C's inputs from a *source* (the reference file, or this run's own captured values), runs C's code,
backpropagates the source's gradient w.r.t. C's outputs, and returns what C's own code produced:
- forward: C's outputs, and the inputs it handed each forced child (`<child key>:input.0`);
- backward: the gradients w.r.t. C's inputs (`grad_input.0`, `grad_kwarg.x`) and w.r.t. each forced child's
  outputs (`<child key>:grad_output`), and each parameter's gradient contribution from C's own code.

A *forced* child does not run: it returns the source's recorded output and, in backward, hands back the source's
recorded gradient w.r.t. its inputs (`_Forced`, an autograd Function). Its hooks are suspended meanwhile (they
belong to the child's computation). A `Site` says where the rerun runs and in which precision: the live module on
the target device as it is (`live`), or `torch.func.functional_call` with parameters cast or taken from the
reference's state_before, on the CPU or the device, with or without autocast. Random ops of C's own code take
the source's recorded values; buffers and RNG states are restored afterwards, so the real iteration never sees
a rerun. A site may also *perturb* every floating value the rerun reads (inputs, forced children's outputs and
gradients, the gradients fed to backward, weights and buffers): the Monte Carlo samples of the calibration
(`Perturbation`).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict, deque
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import (
    BACKWARD,
    FORWARD,
    PLACEMENTS,
    STATE_AFTER,
    STATE_BEFORE,
    STEP_START,
    child_tensor,
    grad_name,
    group_path,
    layout_from_attrs,
    tensor_path,
)
from oneiter.format.stats import pair_sums
from oneiter.record.capture.hooks import PROBED, CallRecord
from oneiter.record.capture.recompute import checkpoint_disabled
from oneiter.record.capture.structure import Slot, fill, flatten, flatten_call
from oneiter.record.local.reduced import ReducedOperands
from oneiter.record.local.rerun_queues import rerun_queues
from oneiter.record.modes import trusted
from oneiter.record.modes.casts import KeptCasts
from oneiter.record.modes.collectives import CollectiveForcer, RecordedCollective, is_distributed
from oneiter.record.modes.randomness import RandomReplayer, RecordedOp
from oneiter.record.modes.roundoff_mode import RoundoffInjection
from oneiter.runtime import host_random, module_state
from oneiter.runtime.compiled import eager, eager_name
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.sharding import as_placed, is_fsdp_hook, local, parse_placements, spec_of, to_placed

__all__ = ["PROBED", "ProbeSkip", "Site", "RunResult", "Rerunner", "AMBIENT", "Perturbation", "scaled_by_signs",
           "tensor_stats", "rel_l2", "with_layout", "stored_layout"]

AMBIENT = "ambient"  # leave autocast as the live call had it (teacher forcing runs inside the target's forward)
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks")
_ABSENT = object()


class ProbeSkip(Exception):
    """This call cannot be rerun faithfully; the message says why (it goes into `/unprobed`)."""


@dataclass(frozen=True)
class Site:
    """Where, and in which precision, one rerun happens.

    `cast`: `live` (every tensor in the dtype it had in the live call), `source` (as the source stored it: the
    reference's own precision), or a dtype name (every floating tensor in that dtype).
    `params`: `live` (the module's own parameters, cast per `cast`) or `reference` (the reference's state_before).
    `trusted`: a trusted recomputation; `--inject-fault` faults and `--fallback` step aside, ops whose CPU kernels are
    not torch's own run through torch's (see `trusted.py`).
    `perturb`: (seed, unit roundoff) of a Monte Carlo sample: every floating value read is perturbed
    (`Perturbation`; only where `live` is False: a live rerun uses the module's own weights).
    `reduced`: (family, mode) pairs of the float32 ops the run it stands for ran reduced (TF32 convolutions): their
    operands are rounded to that mode (`reduced.py`); empty: float32 as it is.
    `inject`: (seed, roundoff, accumulate, families) of a run with a lower precision's rounding injected into every
    op's result (`modes/roundoff_mode.py`: the bound a noise estimate is checked against); None: none.
    """

    name: str
    device: Any
    live: bool
    cast: str
    autocast: Any  # a torch dtype, None for no autocast, or AMBIENT
    params: str
    trusted: bool
    perturb: tuple[int, float] | None = None
    reduced: tuple = ()
    inject: tuple | None = None

    def dtype_for(self, live_dtype, stored_dtype):
        if self.cast == "live":
            return live_dtype
        if self.cast == "source":
            return stored_dtype
        return getattr(torch, self.cast)


class Perturbation:
    """The random relative perturbation of a Monte Carlo sample: each floating value x becomes x * (1 + s * eps),
    s a random sign, eps = 2u for the unit roundoff u of the run's precision or of x's dtype (the coarser): about
    one unit in the last place of the precision the value is computed in, in a random direction. Computed in x's
    dtype (float32 at least, never float64: the devices this is for may have none). The signs come from numpy's
    generator seeded per sample (reproducible, and no torch random op the rerun's replay of recorded random ops
    would take for the model's). `Perturbation(None)` changes nothing."""

    def __init__(self, spec: tuple[int, float] | None):
        self.roundoff = spec[1] if spec else 0.0
        self.generator = np.random.default_rng(int(spec[0])) if spec else None

    def __call__(self, tensor):
        if self.generator is None or not tensor.is_floating_point() or tensor.numel() == 0:
            return tensor
        eps = 2.0 * max(self.roundoff, unit_roundoff(str(tensor.dtype)))
        sign = torch.from_numpy(self.generator.integers(0, 2, size=tuple(tensor.shape), dtype=np.int8))
        return scaled_by_signs(tensor, sign, eps)


def scaled_by_signs(tensor, signs, eps: float):
    """`tensor` * (1 + eps) where `signs` is 1 and * (1 - eps) where it is 0, computed in the tensor's dtype widened
    to float32 at least and stored in its dtype (`Perturbation`, and the twin of a multi-step replay)."""
    work = torch.promote_types(tensor.dtype, torch.float32)
    factor = signs.to(device=tensor.device, dtype=work) * (2.0 * eps) + (1.0 - eps)  # 1 - eps or 1 + eps
    with torch.no_grad():
        return (tensor.to(work) * factor).to(tensor.dtype)


@dataclass
class RunResult:
    """What one rerun produced, by local-table name. `passed`: the (phase, name)s that merely pass on a value
    handed in (a forced child's output given to the next child): nothing of the call's own code is in those.
    `param_grads`: canonical parameter name -> this call's own contribution to its gradient; `buffers`: canonical
    buffer name -> its value after the call, for the buffers the call changed (BatchNorm's running statistics)."""

    forward: dict
    backward: dict
    passed: set
    param_grads: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    internal: dict = field(default_factory=dict)
    """grad name -> the part of an output's recorded gradient that came from the call itself, for outputs the
    call also consumed (a model returning both `logits` and the `loss` computed from them)."""


class Rerunner:
    """Reruns calls from `source` (has/tensor by path). `names` maps id(parameter or buffer) -> canonical name."""

    def __init__(self, source, target_device, random_ops: list[RecordedOp], names: dict[int, str]):
        self.source = source
        self.target_device = torch.device(target_device)
        self.random_ops = random_ops
        self.names = names
        self.collectives: list[RecordedCollective] = []  # the source's, in order (`record/modes/collectives.py`)
        # name -> what the step's gradient is the recorded one divided by (a pipeline schedule's scaling by the
        # number of microbatches after the last backward: `record/modes/pipeline.py`)
        self.grad_divisor: dict[str, float] = {}
        self._state: dict[str, Any] = {}
        self._moved: dict[str, bool] = {}  # buffer name -> whether the source's iteration changed it (`_source_moved`)
        self.perturb = Perturbation(None)  # the running rerun's (`Site.perturb`)
        self.rounded = 0  # ops whose operands the last run rounded (a site with `reduced`)

    def run(self, rec: CallRecord, site: Site, forced: list[CallRecord]) -> RunResult:
        try:
            return self._run(rec, site, forced, own_only=True)
        except (ProbeSkip, OneIterError):
            raise
        except Exception:
            if site.live:
                raise
            # the call's own code may use a forced child's parameters directly (tied weights): give it all of them
            return self._run(rec, site, forced, own_only=False)

    def _run(self, rec: CallRecord, site: Site, forced: list[CallRecord], own_only: bool) -> RunResult:
        module = rec.module
        if rec.args is None or rec.output is None:
            raise ProbeSkip("the call's structure was not kept")
        self.perturb = Perturbation(None if site.live else site.perturb)  # a retry draws the same sample again
        leaves: dict[str, Any] = {}
        given: dict[int, int] = {}  # id -> version of every tensor handed in
        made: dict[str, Any] = {}  # slot name -> what the call was handed there

        def make_input(slot: Slot):
            if slot.alias in made:  # the live call got this very tensor in an earlier place too: so does the rerun
                if slot.alias in leaves:  # its gradient is the one leaf's (the sum over its places, as recorded)
                    leaves[slot.name] = leaves[slot.alias]
                return made[slot.alias]
            made[slot.name] = value = self._input(rec, slot, site, leaves)
            given[id(value)] = value._version
            return value

        with torch.enable_grad():  # the leaves' clones stay in the graph inside a no_grad forward (a reentrant
            args = fill(rec.args, make_input)  # checkpoint's region) too
            kwargs = fill(rec.kwargs, make_input)
        anchor = torch.zeros((), device=site.device, requires_grad=True)
        forcing = _Forcing(forced, self, site, anchor)
        skip = {id(m) for c in forced for m in c.module.modules()} if own_only else set()
        with ExitStack() as stack:
            stack.enter_context(_isolated(module, rec, site.device, self.target_device))
            stack.enter_context(checkpoint_disabled())  # the call's math; no recomputation meets forced children
            stack.enter_context(_without_sharding_hooks(module))
            stack.enter_context(trusted.running(site.trusted))
            if not site.live:  # a compiled block's code stands for its eager code here (`runtime/compiled.py`)
                stack.enter_context(eager())
            _high_precision(stack, site)
            stack.enter_context(_autocast(site, self.target_device))
            reduced = stack.enter_context(_reduced(site))
            params = self._params(rec, site, skip)
            buffers = self._buffers(rec.module, site, params, skip)
            before = {c: t.detach().clone() for c, t in buffers.items()}
            stack.enter_context(forcing)
            stack.enter_context(self._random(rec, forced, site.device))
            stack.enter_context(self._collectives(rec))
            if site.live:
                out = module(*args, **kwargs)
            else:
                out = torch.func.functional_call(module, {n: t for n, (_, t) in params.items()}, tuple(args),
                                                 kwargs, strict=False)
            outputs = {n: v for n, v in flatten(out, "output") if isinstance(v, torch.Tensor)}
            changed = self._changed(buffers, before)
            # An output that *is* an input, unchanged (T5's position_bias: consumed by each block and handed on to
            # the next) gets no gradient seed. The recorded grad_input counts only the call's own consumers of the
            # input (input_grads.py: a pass-through adds no autograd node), while the tensor hook on that output
            # saw the tensor's whole gradient, every consumer's (earlier blocks' too). Seeding it would flow
            # straight back through the input's clone and add that whole to grad_input: a false alarm.
            # One tensor returned in several places has one gradient, recorded whole at each: seeded once.
            seeded, once = {}, set()
            for n, v in outputs.items():
                if given.get(id(v)) != v._version and id(v) not in once:
                    once.add(id(v))
                    seeded[n] = v
            backward, param_grads, internal = self._backward(rec, site, seeded, leaves, params, anchor)
            internal.update(_inherited(outputs, forcing))
        self.rounded = reduced.rounded if reduced is not None else 0
        given.update(forcing.produced)
        forward = {**outputs, **forcing.inputs}
        backward.update(forcing.grad_outputs)
        # a value handed in and passed on unchanged (same object, same version) holds none of this call's work
        passed = {(FORWARD, n) for n, v in forward.items() if given.get(id(v)) == v._version}
        passed |= {(BACKWARD, n) for n, v in backward.items() if given.get(id(v)) == v._version}
        return RunResult({n: local(v).detach() for n, v in forward.items()},
                         {n: local(v).detach() for n, v in backward.items()}, passed, param_grads, changed, internal)

    def _input(self, rec: CallRecord, slot: Slot, site: Site, leaves: dict):
        """The source's value of one input slot for the rerun: a leaf (kept in `leaves`) when it takes a gradient,
        handed in as a clone (an in-place module may overwrite its input; a leaf cannot be), laid out as live."""
        value = self.value(tensor_path(rec.key, FORWARD, slot.name), slot, site, f"input {slot.name}")
        value = to_placed(value, slot.placed)  # a DTensor argument: the recorded shard, placed as it was
        if slot.requires_grad and value.is_floating_point():
            leaf = value.requires_grad_()
            leaves[slot.name] = leaf
            value = leaf.clone()
        if slot.placed is None:
            value = with_layout(value, slot.layout)  # a kernel may depend on strides: the live call's, back
        return value

    def _backward(self, rec: CallRecord, site: Site, outputs: dict, leaves: dict, params: dict, anchor):
        pairs = []
        for name, out in outputs.items():
            path = tensor_path(rec.key, BACKWARD, grad_name(name))
            if out.requires_grad and self.source.has(path):
                # as the live backward had it: a fresh copy, as every value the rerun hands a kernel (`value`; a
                # stored tensor may sit at any address of a memory-mapped file, and oneDNN's convolution weight
                # gradient sums in another order for a grad_output not 16-byte aligned, 4e-7 relative in float32),
                # with the live gradient's strides (ConvNeXt's channels_last one: its layer scale's gradient sums
                # in another order on a contiguous one, 2.4e-7); a shard placed as recorded
                seed = self.perturb(self.source.tensor(path).to(site.device, out.dtype, copy=True))
                placed = self.placed_like(seed, path, out)
                if placed is seed:
                    live = rec.grad_layouts  # known once the live backward reached the call, else as the source had it
                    placed = with_layout(seed, live[grad_name(name)] if grad_name(name) in live
                                         else stored_layout(self.source, path))
                pairs.append((name, out, placed))
        if not pairs:
            return {}, {}, {}
        seeds, internal = _external_grads(pairs)
        weights = [(canonical, t) for canonical, t in params.values() if t.requires_grad]
        targets = [*leaves.values(), *(t for _, t in weights), anchor]
        grads = torch.autograd.grad([o for _, o, _ in pairs], targets, seeds, allow_unused=True)
        # `grads` follows `targets`: the leaves', then the weights', then the anchor's; each zip takes its part
        inputs = {grad_name(n): g for n, g in zip(leaves, grads, strict=False) if g is not None}
        contributions = {c: local(g).detach() for (c, _), g in zip(weights, grads[len(leaves):], strict=False)
                         if g is not None}
        return inputs, contributions, internal

    def value(self, path: str, slot: Slot, site: Site, what: str):
        """A source tensor for `slot`, on the site's device in the site's dtype (a fresh copy)."""
        if not self.source.has(path):
            raise ProbeSkip(f"{what} was not recorded")
        stored = self.source.tensor(path)
        if stored.is_floating_point() or stored.is_complex():
            return self.perturb(stored.to(site.device, site.dtype_for(slot.dtype, stored.dtype), copy=True))
        return stored.to(site.device, copy=True)

    def _params(self, rec: CallRecord, site: Site, skip: set[int]) -> dict[str, tuple[str, Any]]:
        """relative name -> (canonical name, tensor): the parameters and buffers the rerun uses, outside forced
        children. Live sites use the module's own (only parameters, to differentiate); others get fresh tensors
        from the site's source in the site's dtype."""
        prefix = f"{rec.path}." if rec.path else ""
        found = {}
        for name, tensor, is_param in _own_tensors(rec.module, skip):
            canonical = self.names.get(id(tensor), prefix + name)
            if site.live:
                if is_param:
                    found[name] = (canonical, tensor)
                continue
            # buffers start where they were before the iteration (the live ones already hold this call's update)
            stored = self.reference_state(eager_name(prefix + name)) if site.params == "reference" or not is_param \
                else None
            own = local(tensor)  # a tensor-parallel weight (a DTensor): this rank's shard, placed again below
            if stored is not None and tuple(stored.shape) != tuple(own.shape):
                # the source holds this rank's shard of an FSDP2 parameter; the live one is all-gathered while its
                # call runs: the reference's full values in a replay (in the run's dtype)
                stored = None
            base = stored if stored is not None else own.detach()
            if base.is_floating_point() or base.is_complex():
                value = self.perturb(base.to(site.device, site.dtype_for(tensor.dtype, base.dtype), copy=True))
            else:
                value = base.to(site.device, copy=True)
            value = as_placed(value, tensor)
            if is_param and tensor.requires_grad and value.is_floating_point():
                value.requires_grad_()
            found[name] = (canonical, value)
        return found

    def _buffers(self, module, site: Site, params: dict, skip: set[int]) -> dict:
        """canonical name -> the buffer tensor this rerun will use (the live one, or the site's fresh copy)."""
        if not site.live:
            live_ids = {self.names.get(id(t)): n for n, t, is_param in _own_tensors(module, skip) if not is_param}
            return {c: params[n][1] for c, n in live_ids.items() if c is not None and n in params}
        found = {}
        for _, t, is_param in _own_tensors(module, skip):
            name = self.names.get(id(t))
            if is_param or name is None:
                continue
            start = self.reference_state(name)  # where it was before the iteration (restored by _isolated)
            if start is not None and tuple(start.shape) == tuple(t.shape):
                with torch.no_grad():
                    t.data.copy_(start.to(t.device, t.dtype))
            found[name] = t
        return found

    def placed_like(self, value, path: str, like):
        """`value` (the source's tensor at `path`: a shard) as a DTensor placed as the source recorded it (or as
        `like` is, when it did not say), when `like` is a DTensor; `value` itself otherwise."""
        spec = spec_of(like)
        if spec is None:
            return value
        attrs = getattr(self.source, "attrs", None)
        text = attrs(path).get(PLACEMENTS) if callable(attrs) else None
        return to_placed(value, spec, parse_placements(text) if text else None)

    def reference_state(self, name: str):
        """state_before/<name> of the source (None when it has no such entry), read once."""
        if name not in self._state:
            path = group_path(STATE_BEFORE, name)
            self._state[name] = self.source.tensor(path) if self.source.has(path) else None
        return self._state[name]

    def _changed(self, buffers: dict, before: dict) -> dict:
        """The buffers the call updated, with their new values. A call that changed some updates its buffers (the
        version counter does not say: BatchNorm's kernel writes its running statistics without bumping it): one the
        source saw move was written here too, even where the rerun's value is its start (a running mean of a
        zero-mean input, exactly 0 in bf16)."""
        changed = {c: t.detach().clone() for c, t in buffers.items() if not torch.equal(t, before[c])}
        if changed:
            changed.update({c: t.detach().clone() for c, t in buffers.items()
                            if c not in changed and self._source_moved(c)})
        return changed

    def _source_moved(self, name: str) -> bool:
        """Whether the source's iteration changed buffer `name` (its state_after is not its state_before), read once:
        every rerun of the call (its primary, calibration and bound sites) asks."""
        if name not in self._moved:
            path, start = group_path(STATE_AFTER, name), self.reference_state(name)
            after = self.source.tensor(path) if start is not None and self.source.has(path) else None
            self._moved[name] = (after is not None and tuple(after.shape) == tuple(start.shape)
                                 and not torch.equal(after, start))
        return self._moved[name]

    def step_start(self, name: str):
        """Where the source's optimizer step of parameter `name` started: step_start/<name> when the model wrote it
        during the iteration (nn.Embedding(max_norm)), else state_before/<name>; None when it has neither."""
        path = group_path(STEP_START, name)
        return self.source.tensor(path) if self.source.has(path) else self.reference_state(name)

    def _random(self, rec: CallRecord, forced: list[CallRecord], device):
        """Replay the random ops this call's own code ran (forced children's ops do not run in the rerun)."""
        inside = set()
        for child in forced:
            inside.update(range(child.random_begin, child.random_end))
        wanted = [k for k in range(rec.random_begin, max(rec.random_end, rec.random_begin)) if k not in inside]
        if any(k >= len(self.random_ops) for k in wanted):
            raise ProbeSkip("the call ran random ops the source did not record")
        return RandomReplayer(self.source, device, ops=[self.random_ops[k] for k in wanted])


    def _collectives(self, rec: CallRecord):
        """Force the collectives this call's own code ran (and those of the descendants that run live in the rerun:
        the unprobed ones, outside forced calls), forward and backward apart, in the order they ran; with no process
        group and nothing recorded, nothing to do."""
        if not self.collectives and not is_distributed():
            return nullcontext()
        return CollectiveForcer(self.source, rerun_queues(rec, self.collectives, PROBED), lambda t: self.perturb(t),
                                ProbeSkip)


def with_layout(value, layout: tuple | None):
    """`value` with the live call's strides and storage offset (`structure.layout_of`), differentiably: a view into
    a fresh buffer laid out as the live tensor's storage was. None, or a layout that does not fit: `value` as it is.
    """
    if layout is None or value.layout != torch.strided or value.numel() == 0:
        return value
    stride, offset = layout
    size = tuple(value.shape)
    if len(stride) != len(size) or any(s < 0 for s in stride) or offset < 0:
        return value
    if tuple(value.stride()) == tuple(stride) and value.storage_offset() == offset:
        return value
    # where each element sits in the storage: offset + sum(i_k * stride_k); overlapping views (stride 0) write
    # one storage element several times with the same value
    index = torch.full((), offset, dtype=torch.long, device=value.device)
    for dim, (n, step) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[dim] = n
        index = index + torch.arange(n, device=value.device).mul_(step).reshape(shape)
    extent = int(index.max()) + 1
    base = value.new_zeros(extent).index_put((index.reshape(-1),), value.reshape(-1))
    return base.as_strided(size, tuple(stride), offset)


def stored_layout(source, path: str) -> tuple | None:
    """The live layout a source recorded with `path` (its `stride` and `storage_offset` attributes), or None:
    contiguous, or a source that keeps no attributes (this run's own copies, `probe.MemorySource`)."""
    attrs = getattr(source, "attrs", None)
    return layout_from_attrs(attrs(path)) if callable(attrs) else None


def _external_grads(pairs: list) -> tuple[list, dict]:
    """The gradient each output received from *outside* the call, from the recorded (total) ones.

    A recorded grad_output is the whole gradient w.r.t. that output. When the call also consumed one of its own
    outputs (`loss = f(logits)`, both returned), part of that whole came through the call's other outputs;
    backpropagating every output with its whole gradient would count that part twice. Taking the outputs from
    the last computed to the first, the part coming through later outputs is computed and subtracted.
    Returns the seeds for backward (in `pairs` order) and {grad name: the part that came through the call}.
    """
    if len(pairs) == 1:
        return [pairs[0][2]], {}
    order = sorted(range(len(pairs)), key=lambda i: -_sequence(pairs[i][1]))
    seeds: dict[int, Any] = {}
    internal = {}
    for position, i in enumerate(order):
        name, out, whole = pairs[i]
        later = order[:position]
        inner = None
        if later:
            inner = torch.autograd.grad([pairs[j][1] for j in later], [out], [seeds[j] for j in later],
                                        retain_graph=True, allow_unused=True)[0]
        seeds[i] = whole if inner is None else whole - inner
        if inner is not None:
            internal[grad_name(name)] = inner.detach()
    return [seeds[i] for i in range(len(pairs))], internal


def _inherited(outputs: dict, forcing: "_Forcing") -> dict:
    """Outputs this call passes on unchanged from a forced child that also consumed them itself: the child's
    own part of their gradient is part of this call's too (BERT's attention weights, returned up two levels)."""
    found = {}
    for name, out in outputs.items():
        child, slot = forcing.origin.get(id(out), (None, None))
        inner = child.internal.get(grad_name(slot)) if child is not None else None
        if inner is not None:
            found[grad_name(name)] = inner
    return found


def _sequence(tensor) -> int:
    return tensor.grad_fn._sequence_nr() if tensor.grad_fn is not None else -1


class _Forcing:
    """While active, each forced child call returns the source's recorded output and, in backward, hands back the
    source's recorded gradient w.r.t. its inputs; what the caller's own code gave and received is kept."""

    def __init__(self, children: list[CallRecord], rerunner: Rerunner, site: Site, anchor):
        self.rerunner, self.site, self.anchor = rerunner, site, anchor
        self.queues: dict[int, deque] = {}
        self.modules: dict[int, Any] = {}
        for child in children:
            self.queues.setdefault(id(child.module), deque()).append(child)
            self.modules[id(child.module)] = child.module
        self.inputs: dict[str, Any] = {}
        self.grad_outputs: dict[str, Any] = {}
        # id -> version of the tensors handed to the caller; `_alive` keeps them, so no id is reused meanwhile
        self.produced: dict[int, int] = {}
        self._alive: list = []
        self.origin: dict[int, tuple] = {}  # id of a forced output -> (child record, output name)
        self._saved: list = []
        self._calls: list[_ForcedCall] = []

    def __enter__(self):
        for module in self.modules.values():
            # through the instance's own dict: a torch.compile wrapper forwards other attributes to its `_orig_mod`;
            # a module compiled in place runs its compiled call (`_compiled_call_impl`) unless it is cleared
            own = module.__dict__
            saved = {n: own[n] for n in (*_HOOK_DICTS, "_compiled_call_impl") if n in own}
            self._saved.append((module, own.get("forward", _ABSENT), saved))
            for n in saved:
                own[n] = None if n == "_compiled_call_impl" else OrderedDict()
            own["forward"] = functools.partial(self._forward, module)
        return self

    def __exit__(self, exc_type, exc, tb):
        for module, forward, saved in self._saved:
            if forward is _ABSENT:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = forward
            module.__dict__.update(saved)
        self._saved.clear()
        # each stand-in's autograd node holds its _ForcedCall, which held this object and so the stand-in's own
        # outputs (whose grad_fn is that node): a cycle through C++ that Python's collector cannot see, which kept
        # every rerun's tensors alive (~0.7 GB per resnet18 replay). The rerun's backward has run: cut it.
        for info in self._calls:
            info.forcing, info.values = None, []
        self._calls.clear()
        if exc_type is None:
            left = [c.key for q in self.queues.values() for c in q]
            if left:
                raise ProbeSkip(f"the rerun did not call {left[0]} (the calls depend on more than the inputs)")
        return False

    def _forward(self, module, *args, **kwargs):
        queue = self.queues[id(module)]
        if not queue:
            raise ProbeSkip(f"the rerun called {type(module).__name__} more often than the recorded call did")
        child = queue.popleft()
        given, grad_inputs = self._take_inputs(child, args, kwargs)
        outs, grad_slots = self._stand_in_outputs(child, given)
        if grad_slots:
            self._force(child, grad_inputs, grad_slots, outs)
        for slot in child.output.slots:  # one tensor returned in several places: the same one again there
            if slot.alias is not None and slot.name not in outs:
                outs[slot.name] = outs[slot.alias]
        self._hand_out(child, given, outs)
        return fill(child.output, lambda slot: outs[slot.name])

    def _take_inputs(self, child: CallRecord, args: tuple, kwargs: dict) -> tuple[dict, list]:
        """The tensors the caller handed the child (kept in `inputs`), and those a gradient flows back to: a tensor
        handed in several places once (the recorded gradient of each place is the tensor's whole, summed)."""
        grad_inputs, given, once = [], {}, set()
        for name, value in flatten_call(args, kwargs):
            if isinstance(value, torch.Tensor):
                given[name] = value
                self.inputs[child_tensor(child.key, name)] = value
                if value.requires_grad and value.is_floating_point() and id(value) not in once:
                    once.add(id(value))
                    grad_inputs.append((name, value))
        return given, grad_inputs

    def _stand_in_outputs(self, child: CallRecord, given: dict) -> tuple[dict, list]:
        """The child's recorded outputs, by slot; those that need a gradient are returned apart (in slot order), to
        go through the stand-in's autograd node."""
        outs, grad_slots = {}, []
        for slot in child.output.slots:
            if slot.alias is not None:  # the same tensor as an earlier slot (`_forward` fills it in)
                continue
            if child.identity.get(slot.name) in given:  # the child returned this input itself: so does its stand-in
                outs[slot.name] = given[child.identity[slot.name]]
                continue
            value = with_layout(self.rerunner.value(tensor_path(child.key, FORWARD, slot.name), slot, self.site,
                                                    f"output {slot.name} of {child.key}"), slot.layout)
            if slot.requires_grad and value.is_floating_point():
                grad_slots.append((slot, value))
            else:
                outs[slot.name] = to_placed(value, slot.placed)
        return outs, grad_slots

    def _force(self, child: CallRecord, grad_inputs: list, grad_slots: list, outs: dict) -> None:
        """Put the outputs that need a gradient in `outs` as outputs of a stand-in autograd node (`Forced`)."""
        aliases: dict[str, list] = {}
        for slot in child.output.slots:
            aliases.setdefault(slot.alias or slot.name, []).append(slot.name)
        info = _ForcedCall(self, child, [n for n, _ in grad_inputs], [slot.name for slot, _ in grad_slots],
                           [v for _, v in grad_slots], aliases)
        self._calls.append(info)
        results = _forced_function().apply(info, self.anchor, *[v for _, v in grad_inputs])
        for (slot, _), value in zip(grad_slots, results, strict=True):  # Forced returns one value per slot
            outs[slot.name] = to_placed(value, slot.placed)  # a DTensor output: placed as the live one was

    def _hand_out(self, child: CallRecord, given: dict, outs: dict) -> None:
        """Note the outputs the child produced (not inputs it passed on) as handed to the caller, and keep them."""
        passed_on = {id(given[n]) for n in child.identity.values() if n in given}
        self.produced.update((id(v), v._version) for v in outs.values() if id(v) not in passed_on)
        self._alive.extend(outs.values())
        for name, value in outs.items():
            if id(value) not in passed_on:
                self.origin[id(value)] = (child, name)

    def grad_for(self, child: CallRecord, name: str, like, spec: tuple | None = None):
        """The source's gradient w.r.t. a forced child's input, like `like` (placed as a DTensor input was: `spec`)."""
        path = tensor_path(child.key, BACKWARD, grad_name(name))
        if not self.rerunner.source.has(path):
            return None
        grad = self.rerunner.perturb(self.rerunner.source.tensor(path).to(like.device, like.dtype, copy=True))
        if spec is not None:
            attrs = getattr(self.rerunner.source, "attrs", None)
            text = attrs(path).get(PLACEMENTS) if callable(attrs) else None
            grad = to_placed(grad, spec, parse_placements(text) if text else None)
        self.produced[id(grad)] = grad._version
        self._alive.append(grad)
        return grad


@dataclass
class _ForcedCall:
    forcing: _Forcing | None  # None once the rerun is over (`_Forcing.__exit__`)
    child: CallRecord
    input_names: list
    output_names: list
    values: list
    aliases: dict = field(default_factory=dict)  # output name -> every name it was returned under (itself first)


@functools.lru_cache(maxsize=None)
def _forced_function():
    class Forced(torch.autograd.Function):
        """Forward: the recorded outputs of a child call. Backward: keep the gradient arriving at them, return the
        recorded gradient w.r.t. the child's inputs."""

        @staticmethod
        def forward(ctx, info: _ForcedCall, anchor, *inputs):
            ctx.info = info
            ctx.likes = [torch.empty((), dtype=t.dtype, device=t.device) for t in inputs]
            ctx.specs = [spec_of(t) for t in inputs]
            return tuple(info.values)

        @staticmethod
        def backward(ctx, *grads):
            info = ctx.info
            for name, grad in zip(info.output_names, grads, strict=True):  # one per forward output
                # an output the child also consumed itself (logits of a model that returns the loss computed from
                # them): its recorded gradient holds the child's own part, which the reference file does not
                # separate, so what the caller hands it cannot be judged
                if grad is not None and grad_name(name) not in info.child.internal:
                    for each in info.aliases.get(name, [name]):  # every place the tensor was returned in
                        info.forcing.grad_outputs[child_tensor(info.child.key, grad_name(each))] = grad
            likes = zip(info.input_names, ctx.likes, ctx.specs, strict=True)  # all one per input
            back = [info.forcing.grad_for(info.child, name, like, spec) for name, like, spec in likes]
            return (None, None, *back)

    return Forced


@contextmanager
def _autocast(site: Site, target_device) -> Iterator[None]:
    if site.autocast == AMBIENT:
        yield
        return
    with ExitStack() as stack:
        for device_type in {site.device.type, torch.device(target_device).type}:
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        if site.autocast is not None:
            stack.enter_context(torch.autocast(device_type=site.device.type, dtype=site.autocast))
        yield


@contextmanager
def _reduced(site: Site) -> Iterator[Any]:
    """The site's reduced-precision operands (`reduced.ReducedOperands`) for forward and backward, or nothing."""
    if not site.reduced:
        yield None
        return
    with ReducedOperands(dict(site.reduced)) as mode:
        yield mode


@contextmanager
def _without_sharding_hooks(module) -> Iterator[None]:
    """FSDP2's forward hooks off on `module` and every module under it for a rerun: a rerun on one rank must run no
    collective, and must not reduce gradients into the real iteration's. The parameters it reads are those the live
    call had: a call under an FSDP2 unit runs (and is rerun, when it returns) while its unit's parameters are
    all-gathered; the unit itself returns after its parameters are sharded again, so its rerun forces its children
    (a child that is not forced and reads a sharded parameter fails, and the unit is listed as not probed)."""
    saved = []  # (hook dict, its entries in order): restored as they were, FSDP2's pre-hook first
    for mod in module.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(mod, name, None)
            if hooks and any(is_fsdp_hook(h) for h in hooks.values()):
                saved.append((hooks, list(hooks.items())))
                for key in [k for k, h in hooks.items() if is_fsdp_hook(h)]:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


@contextmanager
def _isolated(module, rec: CallRecord, *devices) -> Iterator[None]:
    """Outer dispatch modes off, gradients on; buffers (BatchNorm running stats) and RNG states restored after.
    Python's and numpy's generators, and the tensors the modules keep in plain attributes (RecurrentGemma's
    recurrent state), start where they were when the live call began (`rec.host_random`, `rec.attributes`: the
    model's own draws, SpecAugment's masks, are the live call's again; a rerun never starts from, nor backpropagates
    into, the live call's end state) and are left as they were found."""
    from torch.utils._python_dispatch import _disable_current_modes

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    found = host_random.state()
    if rec.host_random is not None:
        host_random.set_state(rec.host_random)
    cpu_rng = torch.get_rng_state()
    backends = []
    for device in {torch.device(d).type for d in devices} - {"cpu"}:
        backend = getattr(torch, device, None)
        if backend is not None and hasattr(backend, "get_rng_state"):
            backends.append((backend, backend.get_rng_state()))
    try:
        with _disable_current_modes(), torch.enable_grad(), module_state.started(rec.attributes):
            yield
    finally:
        torch.set_rng_state(cpu_rng)
        host_random.set_state(found)
        for backend, state in backends:
            backend.set_rng_state(state)
        with torch.no_grad():
            for live, saved in buffers:
                # through .data: the real iteration saved these buffers for backward (BatchNorm), and a version
                # bump would make autograd reject them
                live.data.copy_(saved)


def _high_precision(stack: ExitStack, site: Site) -> None:
    """The modes of a high-precision site: a lower precision's rounding injected into every op (`inject`), and the
    casts the model's code makes to narrower floats kept (`modes/casts.py`; float64 sites and the calibration's high
    run)."""
    if site.inject is not None:
        stack.enter_context(RoundoffInjection(*site.inject))
    if site.cast == "float64" or site.name == "high":
        stack.enter_context(KeptCasts(site.inject[0] if site.inject is not None else None))


def _own_tensors(module, skip: set[int]) -> list[tuple[str, Any, bool]]:
    """(name relative to `module`, tensor, is_parameter) outside the modules in `skip` (parameters once each)."""
    found: list[tuple[str, Any, bool]] = []
    seen: set[int] = set()

    def walk(mod, prefix: str) -> None:
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append((prefix + name, p, True))
        for name, b in mod._buffers.items():
            if b is not None:
                found.append((prefix + name, b, False))
        for name, child in mod._modules.items():
            if child is not None and id(child) not in skip:
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return found


# -- numbers --------------------------------------------------------------------------------------------------------
def _pair(reference, value):
    """Both tensors flat on the CPU in one floating dtype: the wider of the two, at least float32 (float8 values,
    which torch promotes with nothing, read as float32 first: exactly)."""
    a, b = (_promotable(local(t).detach().reshape(-1)) for t in (reference, value))  # never a tensor subclass
    work = torch.promote_types(a.dtype, b.dtype)
    if not work.is_floating_point or work in (torch.float16, torch.bfloat16):
        work = torch.float64 if not work.is_floating_point else torch.float32
    return a.to("cpu", work), b.to("cpu", work)


def _promotable(t):
    return t.float() if t.is_floating_point() and t.dtype.itemsize == 1 else t


def tensor_stats(reference, value) -> dict:
    """Local metrics of `value` against `reference`; NaN/Inf judged by position and sign.

    Computed in the wider of the two dtypes (float32 at least): differences of nearby floats are exact there.
    On the CPU the C kernel (`format.stats.pair_sums`) reads both once and sums in float64; elsewhere torch's
    reductions run, in the working dtype. A tensor holding NaN/Inf (or |x| near overflow) takes the careful path,
    in float64."""
    a, b = _pair(reference, value)
    sums = pair_sums(a, b)  # the C kernel: one pass, float64 sums
    if sums is not None:
        norm_a, norm_b, diff = (math.sqrt(s) for s in sums[:3])
        dot, max_abs = sums[3], sums[4]
    else:
        d = a - b
        norm_a, norm_b, diff = (torch.linalg.vector_norm(t).item() for t in (a, b, d))
        dot = max_abs = None
    counts = {"nan_ref": 0, "inf_ref": 0, "nan": 0, "inf": 0, "mismatch": 0}
    if not all(math.isfinite(x) for x in (norm_a, norm_b, diff)):
        return _careful_stats(a.double(), b.double())
    rel = diff / norm_a if norm_a else (0.0 if diff == 0 else math.inf)
    if diff == 0:
        cosine = 1.0
    elif norm_a and norm_b:
        dot = torch.dot(a, b).item() if dot is None else dot
        cosine = max(-1.0, min(1.0, dot / (norm_a * norm_b)))
    else:
        cosine = 0.0
    if not diff:
        max_abs = 0.0
    elif max_abs is None:
        max_abs = torch.linalg.vector_norm(d, ord=math.inf).item()
    return {"numel": int(a.numel()), "rel_l2": rel, "max_abs": max_abs, "cosine": cosine, **counts}


def _careful_stats(a, b) -> dict:
    """`tensor_stats` for tensors with NaN/Inf (or values whose squares overflow), in float64."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    both = fa & fb
    same = (a == b) | (nan_a & nan_b)  # +inf next to +inf, NaN next to NaN
    mismatch = int((~both & ~same).sum())
    numel = int(a.numel())
    a, b = a[both], b[both]
    d = a - b
    diff = torch.linalg.vector_norm(d).item()
    norm_a, norm_b = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item()
    rel = diff / norm_a if norm_a else (0.0 if diff == 0 else math.inf)
    cosine = 1.0 if diff == 0 else (max(-1.0, min(1.0, torch.dot(a, b).item() / (norm_a * norm_b)))
                                    if norm_a and norm_b else 0.0)
    return {
        "numel": numel, "rel_l2": rel, "max_abs": d.abs().max().item() if d.numel() else 0.0, "cosine": cosine,
        "nan_ref": int(nan_a.sum()), "inf_ref": int((~fa & ~nan_a).sum()), "nan": int(nan_b.sum()),
        "inf": int((~fb & ~nan_b).sum()), "mismatch": mismatch,
    }


def rel_l2(reference, value) -> float:
    """||value - reference|| / ||reference|| over the positions finite on both sides."""
    if tuple(reference.shape) != tuple(value.shape):
        return math.inf
    a, b = _pair(reference, value)
    sums = pair_sums(a, b)
    if sums is not None:
        norm, diff = math.sqrt(sums[0]), math.sqrt(sums[2])
    else:
        norm, diff = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(a - b).item()
    if not (math.isfinite(norm) and math.isfinite(diff)):
        a, b = a.double(), b.double()
        keep = torch.isfinite(a) & torch.isfinite(b)
        a, b = a[keep], b[keep]
        norm, diff = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(a - b).item()
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)
