"""Rerunning one recorded module call, with its children forced, at a chosen place and precision.

Where this sits: `probe.py` decides what to rerun and judges the results; this module does one rerun. A rerun of
call C takes C's inputs from a *source* (the reference file, or this run's own captured values), runs C's code,
backpropagates the source's gradient w.r.t. C's outputs, and returns what C's own code produced:
- forward: C's outputs, and the inputs it handed each forced child (`<child key>:input.0`);
- backward: the gradients w.r.t. C's inputs (`grad_input.0`, `grad_kwarg.x`) and w.r.t. each forced child's
  outputs (`<child key>:grad_output`), and each parameter's gradient contribution from C's own code.

A *forced* child does not run: it returns the source's recorded output and, in backward, hands back the source's
recorded gradient w.r.t. its inputs (`Forced`, an autograd Function: `rerunning/forcing.py`). Its hooks are
suspended meanwhile (they belong to the child's computation). A `Site` says where the rerun runs and in which
precision: the live module on the target device as it is (`live`), or `torch.func.functional_call` with parameters
cast or taken from the reference's state_before, on the CPU or the device, with or without autocast. Random ops of
C's own code take the source's recorded values; buffers and RNG states are restored afterwards, so the real
iteration never sees a rerun. A site may also *perturb* every floating value the rerun reads (inputs, forced
children's outputs and gradients, the gradients fed to backward, weights and buffers): the Monte Carlo samples of
the calibration (`Perturbation`).

The rerun's parts live in `rerunning/` (its map); this module holds the `Rerunner`, which puts them together, and
re-exports the names the rest of oneiter imports from here. One rerun is a value: `Rerunner.run` hands in the
source's inputs (`HandedIn`), runs the call, backpropagates through its own code (`OwnBackward`) and returns the
`RunResult` built from those (`_result`).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import (
    BACKWARD,
    FORWARD,
    PLACEMENTS,
    STATE_AFTER,
    STATE_BEFORE,
    STEP_START,
    grad_name,
    group_path,
    tensor_path,
)
from oneiter.record.capture.hooks import PROBED, CallRecord
from oneiter.record.capture.structure import Slot, fill, flatten
from oneiter.record.local.rerun_queues import rerun_queues
from oneiter.record.local.rerunning.forcing import Forcing
from oneiter.record.local.rerunning.gradients import external_grads, inherited
from oneiter.record.local.rerunning.isolation import enter_site
from oneiter.record.local.rerunning.rerun_metrics import rel_l2, tensor_stats
from oneiter.record.local.rerunning.site import AMBIENT, Perturbation, ProbeSkip, RunResult, Site, scaled_by_signs
from oneiter.record.local.rerunning.strides import stored_layout, with_layout
from oneiter.record.modes.collectives import CollectiveForcer, RecordedCollective, is_distributed
from oneiter.record.modes.randomness import RandomReplayer, RecordedOp
from oneiter.runtime.compiled import eager_name
from oneiter.runtime.sharding import as_placed, parse_placements, shard_of, spec_of, to_placed

__all__ = ["PROBED", "ProbeSkip", "Site", "RunResult", "Rerunner", "AMBIENT", "Perturbation", "scaled_by_signs",
           "tensor_stats", "rel_l2", "with_layout", "stored_layout"]



@dataclass(frozen=True)
class HandedIn:
    """What a rerun hands the call: its positional and keyword arguments, the leaves the gradients w.r.t. its inputs
    are taken at (slot name -> leaf, in slot order), and the version of every tensor handed in (id -> version)."""

    args: Any
    kwargs: Any
    leaves: dict[str, Any]
    versions: dict[int, int]


@dataclass(frozen=True)
class OwnBackward:
    """What the call's own backward gave: the gradients w.r.t. its inputs (grad name -> gradient), each parameter's
    contribution from its own code (canonical name -> gradient), and the part of each output's recorded gradient
    that came through the call itself (grad name -> gradient: `gradients.external_grads`)."""

    input_grads: dict
    grad_contributions: dict
    internal_grads: dict


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
        if rec.args is None or rec.output is None:
            raise ProbeSkip("the call's structure was not kept")
        self.perturb = Perturbation(None if site.live else site.perturb)  # a retry draws the same sample again
        handed = self._handed_in(rec, site)
        anchor = torch.zeros((), device=site.device, requires_grad=True)
        forcing = Forcing(forced, self, site, anchor)
        skip = {id(m) for c in forced for m in c.module.modules()} if own_only else set()
        with ExitStack() as stack:
            reduced = enter_site(stack, rec, site, self.target_device)
            params = self._params(rec, site, skip)
            buffers = self._buffers(rec.module, site, params, skip)
            before = {c: t.detach().clone() for c, t in buffers.items()}
            stack.enter_context(forcing)
            stack.enter_context(self._random(rec, forced, site.device))
            stack.enter_context(self._collectives(rec))
            if site.live:
                out = rec.module(*handed.args, **handed.kwargs)
            else:
                out = torch.func.functional_call(rec.module, {n: t for n, (_, t) in params.items()},
                                                 tuple(handed.args), handed.kwargs, strict=False)
            outputs = {n: v for n, v in flatten(out, "output") if isinstance(v, torch.Tensor)}
            changed_buffers = self._changed(buffers, before)
            own = self._backward(rec, site, _seeded(outputs, handed.versions), handed.leaves, params, anchor)
        self.rounded = reduced.rounded if reduced is not None else 0
        return _result(outputs, forcing, handed.versions, own, changed_buffers)

    def _handed_in(self, rec: CallRecord, site: Site) -> HandedIn:
        """The source's values of the call's arguments, slot by slot in the order the live call had them. A tensor
        the live call got in several places is handed in once, in each of them: its gradient is the one leaf's (the
        sum over its places, as recorded)."""
        values: dict[str, Any] = {}  # slot name -> what the call is handed there
        leaves: dict[str, Any] = {}
        versions: dict[int, int] = {}
        assert rec.args is not None and rec.kwargs is not None  # released only once the call is probed
        with torch.enable_grad():  # the leaves' clones stay in the graph inside a no_grad forward (a reentrant
            for slot in (*rec.args.slots, *rec.kwargs.slots):  # checkpoint's region) too
                if slot.alias in values:
                    values[slot.name] = values[slot.alias]
                    if slot.alias in leaves:
                        leaves[slot.name] = leaves[slot.alias]
                    continue
                values[slot.name], leaf = self._input(rec, slot, site)
                if leaf is not None:
                    leaves[slot.name] = leaf
                versions[id(values[slot.name])] = values[slot.name]._version
            args = fill(rec.args, lambda slot: values[slot.name])
            kwargs = fill(rec.kwargs, lambda slot: values[slot.name])
        return HandedIn(args, kwargs, leaves, versions)

    def _input(self, rec: CallRecord, slot: Slot, site: Site) -> tuple[Any, Any]:
        """The source's value of one input slot for the rerun, and its leaf (None when it takes no gradient): a
        value that takes a gradient is handed in as a clone of its leaf (an in-place module may overwrite its input;
        a leaf cannot be), laid out as live."""
        value = self.value(tensor_path(rec.key, FORWARD, slot.name), slot, site, f"input {slot.name}")
        value = to_placed(value, slot.placed)  # a DTensor argument: the recorded shard, placed as it was
        leaf = None
        if slot.requires_grad and value.is_floating_point():
            leaf = value.requires_grad_()
            value = leaf.clone()
        if slot.placed is None:
            value = with_layout(value, slot.layout)  # a kernel may depend on strides: the live call's, back
        return value, leaf

    def _backward(self, rec: CallRecord, site: Site, outputs: dict, leaves: dict, params: dict,
                  anchor) -> OwnBackward:
        """Backpropagate the source's gradients w.r.t. the seeded `outputs` through the call's own code."""
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
            return OwnBackward({}, {}, {})
        seeds, internal = external_grads(pairs)
        weights = [(canonical, t) for canonical, t in params.values() if t.requires_grad]
        targets = [*leaves.values(), *(t for _, t in weights), anchor]
        grads = torch.autograd.grad([o for _, o, _ in pairs], targets, seeds, allow_unused=True)
        # `grads` follows `targets`: the leaves', then the weights', then the anchor's; each zip takes its part
        inputs = {grad_name(n): g for n, g in zip(leaves, grads, strict=False) if g is not None}
        contributions = {c: shard_of(g).detach() for (c, _), g in zip(weights, grads[len(leaves):], strict=False)
                         if g is not None}
        return OwnBackward(inputs, contributions, internal)

    def recorded_output(self, child: CallRecord, slot: Slot, site: Site):
        """A forced child's recorded output in `slot` for the rerun, laid out as the live one was (`Forcing`)."""
        return with_layout(self.value(tensor_path(child.key, FORWARD, slot.name), slot, site,
                                      f"output {slot.name} of {child.key}"), slot.layout)

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
            own = shard_of(tensor)  # a tensor-parallel weight (a DTensor): this rank's shard, placed again below
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
            start = self.reference_state(name)  # where it was before the iteration (restored after: `isolation.py`)
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
        inside: set[int] = set()
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


def _seeded(outputs: dict, versions: dict[int, int]) -> dict:
    """The outputs backward is seeded at. An output that *is* an input, unchanged (T5's position_bias: consumed by
    each block and handed on to the next) gets no gradient seed. The recorded grad_input counts only the call's own
    consumers of the input (input_grads.py: a pass-through adds no autograd node), while the tensor hook on that
    output saw the tensor's whole gradient, every consumer's (earlier blocks' too). Seeding it would flow straight
    back through the input's clone and add that whole to grad_input: a false alarm. One tensor returned in several
    places has one gradient, recorded whole at each: seeded once."""
    seeded, once = {}, set()
    for n, v in outputs.items():
        if versions.get(id(v)) != v._version and id(v) not in once:
            once.add(id(v))
            seeded[n] = v
    return seeded


def _result(outputs: dict, forcing: Forcing, versions: dict[int, int], own: OwnBackward,
            changed_buffers: dict) -> RunResult:
    """The rerun's result: the call's outputs and what it handed its forced children (forward), the gradients w.r.t.
    its inputs and its children's outputs (backward), and which of those it merely passed on."""
    versions = {**versions, **forcing.produced}
    forward = {**outputs, **forcing.inputs}
    backward = {**own.input_grads, **forcing.grad_outputs}
    # a value handed in and passed on unchanged (same object, same version) holds none of this call's work
    passed_on = {(FORWARD, n) for n, v in forward.items() if versions.get(id(v)) == v._version}
    passed_on |= {(BACKWARD, n) for n, v in backward.items() if versions.get(id(v)) == v._version}
    return RunResult(forward={n: shard_of(v).detach() for n, v in forward.items()},
                     backward={n: shard_of(v).detach() for n, v in backward.items()}, passed_on=passed_on,
                     grad_contributions=own.grad_contributions, changed_buffers=changed_buffers,
                     internal_grads={**own.internal_grads, **inherited(outputs, forcing)})
