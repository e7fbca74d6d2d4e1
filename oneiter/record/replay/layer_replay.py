"""`oneiter replay`: run one recorded layer alone, from its recorded inputs and weights.

Where it sits: reads a recording through `IterationFile` (like compare), rebuilds the model from the file's meta
like `record --replay` (spec, model_args, batch_size, seed, then the recorded `state_before` bits), takes one
submodule, and runs that one call again: forward from `forward/input.*`, backward from `backward/grad_output*`.
Each output, input gradient and (when attributable) parameter gradient it produces is handed, as a host array, to
the caller's `check` with the recorded tensor's path: `oneiter.judge.replayed.layer_verdict.replay_layer` judges them
(record never imports judge).
It is the layer-level analogue of ditorch's `run_op_from_data`: on the recording's device the result should be
bitwise equal; on another device the error and the time per run show what that one layer costs.

Each input and output gradient gets the strides and storage offset the live call's tensor had (the dataset
attributes `stride`/`storage_offset`, `rerun.with_layout`), so a kernel wrong only for a transposed view fails here
too; the random ops the call ran (dropout) take the reference's recorded values (`randomness.RandomReplayer`).
`trace_layer` runs the same call once under an `ops.OpTracer` (every aten op judged on its own inputs: `op_rerun.py`)
and again on the CPU in float64, the layer's own program computed exactly, for `oneiter replay --ops`.

A compiled layer (`compile=` a torch.compile backend, or a block the rebuilt model compiles itself) runs its
compiled code in the checked and timed runs; the float64 and reference-precision runs stand for its eager code and
run it eagerly. `trace_layer` then judges the nodes of its compiled graphs instead of aten ops
(`graph_ops.GraphTracer`: the kernels inside compiled code pass no dispatch mode).

Limits, by design:
- the layer runs in train mode (as recorded); a recording without random-op values (the mmengine hook's) leaves
  dropout to a fresh RNG: it does not reproduce, and the report says so;
- an argument that was neither a tensor nor an int/float/bool/str/None was not recorded: that call cannot run;
- parameter gradients are compared only when the layer was called once and shares no parameter with another
  module; a parameter also used functionally elsewhere in the model cannot be detected and would differ.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import (
    BACKWARD,
    FORWARD,
    PARAM_GRADS,
    ROOT_MODULE,
    UNREDUCED_GRADS,
    call_key,
    natural_key,
    tensor_to_numpy,
)
from oneiter.record.capture.hooks import flatten
from oneiter.record.capture.sink import host_copy
from oneiter.record.capture.structure import flatten_call
from oneiter.record.local.rerun import with_layout
from oneiter.record.modes import trusted
from oneiter.record.modes.casts import KeptCasts
from oneiter.record.modes.float8 import convert as convert_float8
from oneiter.record.modes.randomness import RandomReplayer, recorded_random_ops
from oneiter.record.replay.graph_ops import GraphTracer
from oneiter.record.start.reference import load_state
from oneiter.runtime.compiled import check_backend, compile_modules, eager_name, find_blocks
from oneiter.runtime.devices import resolve_device
from oneiter.runtime.modelspec import load_model, spec_for_replay
from oneiter.runtime.precision import amp_dtype_name, apply_dtype, autocast_for, torch_dtype, unit_roundoff

__all__ = ["LayerRun", "run_layer", "Check", "RECORDED", "LayerTrace", "trace_layer"]

RECORDED = "recorded"  # `amp=RECORDED`: the autocast the recording ran with (its `amp` attribute)

Check = Callable[[str, IterationFile, str, "tuple[np.ndarray, str] | None"], Any]
"""`check(name, recording, recorded path, (array, dtype) produced or None)`: one tensor's check, kept in `checks`."""


@dataclass
class LayerRun:
    """What `run_layer` did. `checks` holds what the caller's `check` returned for each tensor, in report order;
    times are seconds per timed run, one entry per `repeat` (the checked run is an untimed warm-up)."""

    path: str
    layer: str
    call: int
    class_name: str
    device: str
    dtype: str
    amp: str | None
    checks: list = field(default_factory=list)
    forward_seconds: list[float] = field(default_factory=list)
    backward_seconds: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Why a mismatch may be expected (random layers), for the report."""

    @property
    def key(self) -> str:
        return call_key(self.layer, self.call)

    def timing(self) -> dict[str, dict[str, float]]:
        """{'forward': {'median': s, 'min': s}, 'backward': {...}} over the runs (backward only when run)."""
        out = {}
        for phase, seconds in (("forward", self.forward_seconds), ("backward", self.backward_seconds)):
            if seconds:
                out[phase] = {"median": statistics.median(seconds), "min": min(seconds)}
        return out


def run_layer(
    path: str | Path, layer: str, check: Check, *, call: int = 0, device: str = "cpu", repeat: int = 1,
    dtype: str | None = None, model: str | None = None, amp: str | None = RECORDED, compile: str | None = None,
    float8: str | None = None,
) -> LayerRun:
    """Run call `call` of module `layer` of the recording at `path` on `device`: once (untimed) to `check` what it
    produced, then `repeat` timed runs.

    `layer` is a module path from `named_modules()` ("" or "(root)" for the model itself). `dtype` casts the
    layer and its floating inputs (default: keep the recorded --dtype); `amp` is the autocast to run under
    (`bf16`, `fp16`, None for none; default: the recording's own --amp).
    `model` builds the model: required when the recording was made from a model file (a recording never chooses
    which code runs); a built-in model's recorded name is used when it is None. `compile`: a torch.compile backend
    the layer is compiled with (default: the one the rebuilt model compiles it with, if it does). `float8`: the
    rebuilt model's Linears converted to torchao's float8 training recipe of that name first (`record --float8`).
    """
    if repeat < 1 or call < 0:
        raise OneIterError(f"expected --repeat >= 1 and --call >= 0, got --repeat {repeat} --call {call}")
    with IterationFile(path) as ref:
        opened = _open(ref, layer, call, device, dtype, amp, model, compile, float8)
        result = opened.result
        runner = opened.runner(check, opened.device, opened.cast, result.amp, backend=opened.backend)
        _checked_run(runner, result.key)  # untimed: a first call pays one-off costs (thread pools, allocator, ...)
        for _ in range(repeat):
            forward_seconds, backward_seconds = runner.run()
            result.forward_seconds.append(forward_seconds)
            if backward_seconds is not None:
                result.backward_seconds.append(backward_seconds)
        result.checks, result.notes = runner.checks, result.notes + runner.notes
    return result


@dataclass
class LayerTrace:
    """What `trace_layer` ran: the layer's run (its `checks` empty), and what each run produced by tensor name
    (`output`, `grad_input.0`, `param_grad.weight`: host arrays, None where a run produced none), per site:
    `target` (the traced run: device, dtype and autocast as asked), `float64` (the CPU, float64, no autocast: the
    layer's own program computed exactly) and, when the recording's precision is coarser than the run's,
    `reference` (the CPU in the recording's precision)."""

    run: LayerRun
    recorded: dict[str, str]
    """Tensor name -> the recorded dataset it is judged against, in report order."""
    produced: dict[str, dict[str, Any]]
    grads_comparable: bool
    """False when an output is computed from another output: recorded output gradients are totals, so the input and
    parameter gradients of a replay are not expected to match (`_derived_outputs`)."""
    random_values: bool = True
    """False when the call ran random ops the recording holds no values for: no run reproduces the reference's."""
    tracer: Any = None
    """What judged the traced run op by op: the caller's `OpTracer`, or a `GraphTracer` for a compiled layer."""


def trace_layer(
    path: str | Path, layer: str, tracer, *, call: int = 0, device: str = "cpu", dtype: str | None = None,
    model: str | None = None, amp: str | None = RECORDED, compile: str | None = None, float8: str | None = None,
) -> LayerTrace:
    """Run call `call` of `layer` once under `tracer` (a context per phase: `tracer.watching("forward")`,
    `ops.OpTracer`; a compiled layer's: a `GraphTracer`), then again on the CPU in float64 (and in the recording's
    precision when it is coarser than the run's): the runs `oneiter replay --ops` judges. Arguments as
    `run_layer`'s."""
    if call < 0:
        raise OneIterError(f"expected --call >= 0, got --call {call}")
    import torch

    with IterationFile(path) as ref:
        opened = _open(ref, layer, call, device, dtype, amp, model, compile, float8)
        result = opened.result
        produced: dict[str, dict[str, Any]] = {}
        if opened.backend:
            tracer = GraphTracer(opened.backend)
            result.notes.append(f"compiled with {opened.backend}: judged are the nodes of its compiled forward "
                                f"graphs (each compiled value against its own op in float64); the backward graph "
                                f"and the kernels inside compiled code are not observable op by op")
        target = opened.runner(_collect, opened.device, opened.cast, result.amp,
                               backend=tracer.backend() if opened.backend else None)
        _checked_run(target, result.key, tracer=tracer)
        produced["target"] = dict(target.checks)
        cpu = torch.device("cpu")
        exact = opened.runner(_collect, cpu, torch.float64, None, trusted=True)
        _checked_run(exact, result.key)
        produced["float64"] = dict(exact.checks)
        coarser = opened.reference_precision(result.dtype, result.amp)
        if coarser is not None:
            reference = opened.runner(_collect, cpu, torch_dtype(coarser[0]), coarser[1], trusted=True)
            _checked_run(reference, result.key)
            produced["reference"] = dict(reference.checks)
        result.notes = result.notes + target.notes
        recorded = {name: target.paths[name] for name, _ in target.checks}
    return LayerTrace(result, recorded, produced, grads_comparable=not target.notes,
                      random_values=opened.random_ops is not None, tracer=tracer)


def _collect(name: str, ref: IterationFile, path: str, got):
    return name, got


def _checked_run(runner: _Runner, key: str, tracer=None) -> None:
    """`runner.run(judge=True)`; an error of the layer's own code is one line (exit 2)."""
    try:
        runner.run(judge=True, tracer=tracer)
    except (RuntimeError, TypeError, ValueError) as exc:
        text = (str(exc).strip().splitlines() or [""])[0]
        raise OneIterError(f"replaying {key} failed: {type(exc).__name__}: {text}") from exc


@dataclass
class _Opened:
    """One recorded call, ready to run: the layer with the recorded weights (on the CPU), its tensors by name, the
    reference's random ops it ran, and the `LayerRun` describing it."""

    ref: IterationFile
    result: LayerRun
    module: Any
    attrs: dict[str, Any]
    entries: dict[str, str]
    param_paths: dict[str, str]
    random_ops: list | None
    device: Any
    cast: Any
    backend: str | None = None
    """The torch.compile backend the layer runs compiled with (None: eager)."""

    def runner(self, check: Check, device, cast, amp: str | None, *, trusted: bool = False,
               backend=None) -> _Runner:
        """A runner over a fresh copy of the layer on `device`, cast to `cast` (None: as recorded), under `amp`;
        compiled with `backend` (a name or a backend callable; None: eager)."""
        module = copy.deepcopy(self.module)
        module = module.to(device=device, dtype=cast) if cast is not None else module.to(device)
        if backend is not None:
            compile_modules(module, backend, [])
        return _Runner(self, module, device, cast, autocast_for(device, amp), check, trusted)

    def layout(self, name: str) -> tuple | None:
        """The live tensor's (strides, storage offset) as the recording holds them (validated on open), or None."""
        return self.ref.layout(self.entries[name])

    def reference_precision(self, dtype: str, amp: str | None) -> tuple[str, str | None] | None:
        """(dtype, amp) of the recording when it computed in a coarser precision than `dtype`/`amp`, else None."""
        ref_dtype, ref_amp = str(self.ref.meta.get("dtype") or "float32"), self.ref.meta.get("amp") or None
        mine = unit_roundoff(amp_dtype_name(amp) or dtype)
        theirs = unit_roundoff(amp_dtype_name(ref_amp) or ref_dtype)
        return (ref_dtype, ref_amp) if theirs > mine else None


def _open(ref: IterationFile, layer: str, call: int, device: str, dtype: str | None, amp: str | None,
          model: str | None, compile: str | None = None, float8: str | None = None) -> _Opened:
    """Find call `call` of `layer` in `ref`, rebuild the layer with the recorded weights, and describe the run."""
    layer = "" if layer == ROOT_MODULE else layer
    dev = resolve_device(device)
    cast = torch_dtype(dtype) if dtype else None
    attrs, num_calls = _find_call(ref, layer, call)
    module, param_paths, backend = _build_layer(ref, layer, single_call=num_calls == 1, model=model, float8=float8)
    if compile:  # after the model file ran: importing it may register its backend
        check_backend(compile)
    amp = (ref.meta.get("amp") or None) if amp == RECORDED else amp
    autocast_for(dev, amp)  # an unknown --amp is refused here, before anything runs
    random_ops = _random_ops(ref, attrs)
    result = LayerRun(
        str(ref.path), layer, call, str(attrs.get("class_name", type(module).__name__)), str(dev),
        dtype or ref.meta.get("dtype") or "float32", amp, notes=_notes(module) if random_ops is None else [],
    )
    entries = {e.tensor: e.path for e in ref.entries()
               if (e.module, e.call) == (layer or ROOT_MODULE, call) and e.phase in (FORWARD, BACKWARD)}
    return _Opened(ref, result, module, attrs, entries, param_paths, random_ops, dev, cast, compile or backend)


def _random_ops(ref: IterationFile, attrs: dict[str, Any]) -> list | None:
    """The reference's random ops this call ran (its `random_begin`..`random_end`), [] when it ran none, None when
    the recording holds no values for them."""
    begin, end = int(attrs.get("random_begin", 0) or 0), int(attrs.get("random_end", 0) or 0)
    if end <= begin:
        return []
    ops = recorded_random_ops(ref)
    return ops[begin:end] if end <= len(ops) else None


def _find_call(ref: IterationFile, layer: str, call: int) -> tuple[dict[str, Any], int]:
    """The group attrs of `layer@call` and the layer's number of calls; a OneIterError naming what exists."""
    _check_whole(ref)
    calls: dict[str, dict[int, dict[str, Any]]] = {}
    for _key, attrs in ref.calls():
        calls.setdefault(attrs["module"], {})[int(attrs["call"])] = attrs
    label = layer or ROOT_MODULE
    if layer not in calls:
        names = [m or ROOT_MODULE for m in calls]
        close = difflib.get_close_matches(label, names, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else "`oneiter inspect` lists the recorded modules"
        raise OneIterError(f"'{ref.path.name}' has no recorded module '{label}'; {hint}")
    if call not in calls[layer]:
        recorded = ", ".join(str(c) for c in sorted(calls[layer]))
        raise OneIterError(f"'{label}' has no call {call} in '{ref.path.name}': recorded calls are {recorded}")
    return calls[layer][call], len(calls[layer])


def _check_whole(ref: IterationFile) -> None:
    """Refuse, in one line, a file a layer cannot be replayed from in one process: several steps (no step's values
    in full), or a rank's file of a model that split itself over ranks (FSDP2, tensor parallelism: it holds this
    rank's shard of each parameter, and the layer's collectives need the other ranks)."""
    if ref.steps():
        raise OneIterError(f"'{ref.path.name}' records several steps (--steps), each as statistics: a layer is "
                           f"replayed from one iteration in full; record the step with --step S (the command "
                           f"`oneiter compare` prints) and replay that file")
    world = int(ref.meta.get("world_size") or 1)
    if world > 1 and str(ref.meta.get("grad_reduction") or "") != "allreduce_mean":
        raise OneIterError(f"'{ref.path.name}' is rank {ref.meta.get('rank')}'s file of a model split over {world} "
                           f"ranks (FSDP2 or tensor parallelism): it holds that rank's shard of each parameter, and a "
                           f"layer replay runs the layer whole in one process; compare the rank files instead "
                           f"(`oneiter compare`), whose reruns ran on every rank")


def _build_layer(ref: IterationFile, layer: str, *, single_call: bool, model: str | None = None,
                 float8: str | None = None):
    """A private CPU copy of `layer` with the recorded weights (eager: compiled code left out of it), {`param_grad.
    <name>`: dataset path} to check, and the backend the rebuilt model compiles the layer with (None: it does not).

    Parameter gradients are attributable to this call only when it is the layer's single call (`single_call`)
    and no parameter is shared with another module."""
    import torch

    meta = ref.meta
    with torch.random.fork_rng(devices=[]):  # load_model seeds the global RNG: leave the caller's alone
        bundle = load_model(spec_for_replay(meta.get("model"), model, ref.path.name), int(meta["batch_size"]),
                            int(meta["seed"]),
                            json.loads(meta.get("model_args") or "{}"))
    apply_dtype(bundle, meta.get("dtype") or "float32")  # before loading, so that float64 states load exactly
    if float8:  # the same parameters in torchao's Float8Linears (`record --float8`)
        convert_float8(bundle.model, float8)
    load_state(bundle.model, ref)  # the weights; the layer runs on its own recorded inputs, never the batch
    modules = {eager_name(path): m for path, m in bundle.model.named_modules()}  # a wrapper's module: the eager one
    if layer not in modules:
        raise OneIterError(
            f"model '{meta['model']}' as built now has no module '{layer}': recorded with another version of it?")
    module = modules[layer]
    block = find_blocks(bundle.model).by_path.get(layer)
    uses: dict[int, int] = {}
    for _name, param in bundle.model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    param_paths = {}
    if single_call:  # a rank's own gradients, before DDP averaged them over ranks (a single rank's run: the same)
        grads = ref.state(UNREDUCED_GRADS) or ref.state(PARAM_GRADS)
        for name, param in module.named_parameters():
            full = eager_name(f"{layer}.{name}" if layer else name)
            if param.requires_grad and uses[id(param)] == 1 and full in grads:
                param_paths[f"param_grad.{name}"] = grads[full]
    layer_copy = copy.deepcopy(module).train()  # train mode, as recorded (training.prepare)
    for name in ("_compiled_call_impl", "forward"):  # compiled code of the original: compiled again when asked
        if name in layer_copy.__dict__ and (name != "forward" or block is not None and block.kind == "forward"):
            del layer_copy.__dict__[name]
    return layer_copy, param_paths, block.backend if block is not None else None


def _notes(module) -> list[str]:
    """For a recording without the values of the call's random ops: say that its dropout layers draw anew."""
    import torch

    random = sorted({type(m).__name__ for m in module.modules()
                     if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0})
    if not random:
        return []
    return [f"contains {', '.join(random)} (p > 0) and the recording holds no values for its random ops: it draws "
            "new random numbers, so it is not expected to reproduce"]


class _Runner:
    """Runs the layer once per `run`, timing forward and backward; `run(judge=True)` also sets `checks`."""

    def __init__(self, opened: _Opened, module, device, cast, autocast, check: Check, trusted: bool = False):
        self.opened, self.ref, self.module, self.attrs = opened, opened.ref, module, opened.attrs
        self.entries, param_paths = opened.entries, opened.param_paths
        self.device, self.cast, self.autocast, self.trusted = device, cast, autocast, trusted
        self.params = {f"param_grad.{n}": p for n, p in module.named_parameters() if f"param_grad.{n}" in param_paths}
        self.param_paths, self.paths = param_paths, {**self.entries, **param_paths}
        self.check = check
        self.checks: list = []
        self.notes: list[str] = []
        self.sync = _synchronizer(device)
        self._cpu: dict[str, Any] = {}

    def _tensor(self, name: str, dtype=None):
        """A fresh device copy of the recorded tensor `name` (cast floating ones to `dtype` or --dtype)."""
        if name not in self._cpu:
            self._cpu[name] = self.ref.tensor(self.entries[name])
        tensor = self._cpu[name].to(self.device, copy=True)
        dtype = dtype or self.cast
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    def _laid_out(self, name: str, tensor):
        """`tensor` with the strides and storage offset the live call's tensor `name` had."""
        return with_layout(tensor, self.opened.layout(name))

    def _arguments(self) -> tuple[list, dict, dict]:
        """Fresh args and kwargs for one run, and {grad_input name: leaf} for inputs whose gradient was recorded."""
        leaves, fed = {}, {}
        for name in self.entries:
            if not name.startswith(("input.", "kwarg.")):
                continue
            tensor = self._tensor(name)
            grad_name = f"grad_input.{name.split('.')[1]}"
            if name.count(".") == 1 and grad_name in self.entries and tensor.is_floating_point():
                leaves[grad_name] = tensor.requires_grad_(True)
                tensor = tensor.clone()  # an in-place layer (ReLU(inplace=True)) must not write into a leaf
            fed[name] = self._laid_out(name, tensor)
        for attr, value in self.attrs.items():
            if attr.startswith("arg."):  # non-tensor arguments; capture stores None as "None"
                fed[attr[4:]] = None if value == "None" else value
        tree = _unflatten(fed)
        kwargs = {k: _rebuild(v, f"kwarg.{k}") for k, v in tree.get("kwarg", {}).items()}
        return _rebuild(tree.get("input", {}), "input"), kwargs, leaves

    def _random(self):
        """The reference's values for the random ops the call ran (none to replay, or none recorded: nothing)."""
        if not self.opened.random_ops:
            return contextlib.nullcontext()
        return RandomReplayer(self.ref, self.device, ops=self.opened.random_ops)

    def run(self, *, judge: bool = False, tracer=None) -> tuple[float, float | None]:
        """One forward (and backward, when a gradient was recorded); returns their seconds (backward None).
        `tracer`: a context per phase around the forward and the backward (`ops.OpTracer.watching`)."""
        import torch

        args, kwargs, leaves = self._arguments()
        given = {id(v): v._version for _, v in flatten_call(args, kwargs) if isinstance(v, torch.Tensor)}
        kept = KeptCasts() if self.cast == torch.float64 else contextlib.nullcontext()  # the program computed exactly
        with self._random(), trusted.running(self.trusted), torch.enable_grad(), kept:
            self.sync()
            start = time.perf_counter()
            with self.autocast if self.autocast is not None else contextlib.nullcontext(), _watch(tracer, FORWARD):
                output = self.module(*args, **kwargs)
            self.sync()
            forward_seconds, backward_seconds = time.perf_counter() - start, None
            outputs = dict(flatten(output, "output"))
            grad_names = {name[5:]: name for name in self.entries if name.startswith("grad_output")}
            # an output that is an input handed back unchanged (same version as before the call) gets no seed: its
            # recorded gradient is every consumer's, the recorded grad_input only this layer's own (as in rerun.py)
            pairs = [(outputs[o], g) for o, g in grad_names.items() if getattr(outputs.get(o), "requires_grad", False)
                     and given.get(id(outputs[o])) != outputs[o]._version]
            targets = {**leaves, **self.params}
            grads = None
            if pairs and targets:
                grad_outputs = [self._laid_out(name, self._tensor(name, out.dtype)) for out, name in pairs]
                self.sync()
                start = time.perf_counter()
                with _watch(tracer, BACKWARD):
                    grads = torch.autograd.grad([out for out, _ in pairs], list(targets.values()), grad_outputs,
                                                allow_unused=True)
                self.sync()
                backward_seconds = time.perf_counter() - start
        if judge:
            seeded = {n: t for n, t in outputs.items() if given.get(id(t)) != getattr(t, "_version", None)}
            self.notes = _derived_outputs(seeded) if grads is not None else []
            got = {n: v for n, v in outputs.items() if n in self.entries}
            if grads is not None:
                # autograd.grad returns one gradient per target
                got.update({n: torch.zeros_like(t) if g is None else g
                            for (n, t), g in zip(targets.items(), grads, strict=True)})
            self.checks = self._judge(got)
        return forward_seconds, backward_seconds

    def _judge(self, got: dict[str, Any]) -> list:
        """Checks in a stable order: outputs, input gradients, parameter gradients (a missing one is checked as
        None: it never passes)."""
        ordered = sorted(self.entries, key=natural_key)
        recorded = [n for head in ("output", "grad_input") for n in ordered if n.startswith(head)]
        if any(n in got for n in self.param_paths):  # else no backward ran: no parameter gradient to attribute
            recorded += list(self.param_paths)
        return [self.check(name, self.ref, self.paths[name], _host(got.get(name))) for name in recorded]


def _watch(tracer, phase: str):
    return contextlib.nullcontext() if tracer is None else tracer.watching(phase)


def _host(got) -> tuple[np.ndarray, str] | None:
    """A produced tensor as it would be stored (host array, torch dtype name); None when the run did not produce it."""
    return None if got is None else tensor_to_numpy(host_copy(got))


def _derived_outputs(outputs: dict[str, Any]) -> list[str]:
    """A note for each output computed from another output of the same call.

    The recorded gradient of an output is its total gradient, including what flowed back through the outputs
    derived from it; the replay seeds every output with its own, so that part is counted twice."""
    nodes = {t.grad_fn: n for n, t in outputs.items() if getattr(t, "grad_fn", None) is not None}
    notes = []
    for node, name in nodes.items() if len(nodes) > 1 else ():
        source = _first_reached(node, nodes)
        if source is not None:
            notes.append(f"{name} is computed from {source}: recorded output gradients are totals, so input and "
                         "parameter gradients are not expected to match")
    return notes


def _first_reached(start, targets: dict) -> str | None:
    """The name of the first node of `targets` upstream of `start` in the autograd graph, or None."""
    stack, seen = [start], {start}
    while stack:
        for parent, _ in stack.pop().next_functions:
            if parent is None or parent in seen:
                continue
            if parent in targets:
                return targets[parent]
            seen.add(parent)
            stack.append(parent)
    return None


def _unflatten(leaves: dict[str, Any]) -> dict[str, Any]:
    """{'input.0': a, 'input.1.0': b, 'kwarg.m': c} -> {'input': {'0': a, '1': {'0': b}}, 'kwarg': {'m': c}}."""
    tree: dict[str, Any] = {}
    for name, value in leaves.items():
        node = tree
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _rebuild(node: Any, name: str) -> Any:
    """A nested dict back to what `capture.flatten` flattened: keys 0..n-1 become a list, others stay a dict."""
    if not isinstance(node, dict):
        return node
    items = {k: _rebuild(v, f"{name}.{k}") for k, v in node.items()}
    if not all(k.isdigit() for k in items):
        return items
    indices = sorted(int(k) for k in items)
    if indices != list(range(len(indices))):
        missing = min(set(range(max(indices) + 1)) - set(indices))
        raise OneIterError(f"cannot replay: argument '{name}.{missing}' was not recorded "
                           "(only tensors and int, float, bool, str, None values are)")
    return [items[str(i)] for i in indices]


def _synchronizer(device):
    """A callable that waits for `device`'s queued work (a no-op on the CPU), so timings measure the kernels."""
    import torch

    if device.type == "cpu":
        return lambda: None
    sync = getattr(getattr(torch, device.type, None), "synchronize", None) or torch.accelerator.synchronize
    return lambda: sync(device)
