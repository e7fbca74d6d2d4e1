"""Random ops recorded on the reference and replayed on the target, so dropout compares exactly across RNGs.

Where this sits: `recorder.py` (the Recorder) wraps the reference iteration's forward and backward in a
`RandomRecorder`, a `TorchDispatchMode` that lets every aten op run and copies the values each random op produced into
the group `random/` of the recording. A target run (`--replay`) wraps the same span in a `RandomReplayer`, which lets
each random op run too (so the target consumes its RNG exactly as it would without oneiter, and shapes, dtypes and
devices are the target's own) and then overwrites the drawn values with the reference's. Dispatch modes sit below
autograd and autocast, so both work inside backward and under `torch.autocast`.

Layout (the group name is `format.schema.RANDOM`)::

    /random                    attrs num_ops, ops (full op names, in execution order)
    /random/<index:05d>        the values of a single-output random op; attrs op, index, output
    /random/<index:05d>.<i>    output i of a multi-output op (native_dropout: .0 output, .1 mask)

Bernoulli draws are stored as bool (exact: they are 0 or 1) and turned back into the target's dtype on replay.

What dropout hits (torch 2.13, measured): on the CPU nn.Dropout, F.dropout (also inplace), dropout2d,
alpha_dropout and scaled_dot_product_attention's dropout all lower to `aten.bernoulli_.float` on a fresh noise
tensor, with or without requires_grad; `at::dropout` uses the fused `aten.native_dropout` only on CUDA, XPU, lazy
and PrivateUse1 (DIPU) devices. So one nn.Dropout is `bernoulli_` on a CPU reference and `native_dropout` on a
device target: the replayer treats the two as the same dropout mask and converts between them.

Activation checkpointing reruns a region's forward during backward, random ops included, from the RNG state its
forward started with (torch restores it): the recomputation must draw what the first execution drew, or the
gradients would be computed from another dropout mask than the forward's. Each random op of the forward is keyed by
the state of the generator it draws from, read just before it runs; a random op during backward whose state is
such a key is that op again: the recorder does not record it twice (torch redraws the same values), the replayer
gives it the same reference values as the first time. (Without `preserve_rng_state` a recomputation draws anew,
with or without oneiter; such an op is then a new one on both sides.)

Limits:
- the target must run the same random ops in the same order with the same shapes, else `OneIterError`;
- a random value recorded in float32 and replayed into a bfloat16 op is rounded (masks are exact in any dtype);
- replayed `native_dropout` computes `input * (mask * scale)`: bitwise equal to the CPU kernel (checked for
  float32/64, bfloat16, float16); other devices' fused kernels may round differently;
- replayed rrelu is `input * noise`: bitwise in float32/64, one rounding off the CPU kernel in bfloat16/float16;
- fused attention kernels that draw dropout internally (CUDA flash/efficient SDPA) are invisible here.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from oneiter.errors import OneIterError
from oneiter.format.schema import RANDOM, RANDOM_OPS, group_path
from oneiter.record.capture.recompute import in_backward
from oneiter.record.modes.dispatch import IterationMode, compiling, is_higher_order

__all__ = [
    "RANDOM", "RANDOM_OPS", "RandomRecorder", "RandomReplayer", "RecordedOp", "recorded_random_ops", "is_random",
    "dropout_with_mask",
]


_BERNOULLI = frozenset({"bernoulli", "bernoulli_"})
_DROPOUT_MASK = frozenset({"bernoulli_", "native_dropout"})  # one nn.Dropout: CPU vs fused device kernel
_RRELU = frozenset({"rrelu_with_noise", "rrelu_with_noise_"})


def _packet(func) -> str:
    return func.overloadpacket.__name__


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default):
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def is_random(func, args: tuple, kwargs: dict) -> bool:
    """Whether this aten call draws random numbers (dropout and rrelu only in training mode)."""
    name = _packet(func)
    if name not in RANDOM_OPS:
        return False
    if name == "native_dropout":
        return _arg(args, kwargs, 2, "train", True) is not False  # train=None means training
    if name in _RRELU:
        return bool(_arg(args, kwargs, 4, "training", False))
    return True


def _random_values(func, args: tuple, result) -> list:
    """The tensors an op's randomness ends up in: its outputs, or the noise argument rrelu fills."""
    if _packet(func) in _RRELU:
        return [args[1]]
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def rng_key(args: tuple, kwargs: dict) -> bytes | None:
    """A fingerprint of the state of the generator a random op is about to draw from (its `generator=`, else the
    default generator of its device), or None where that state cannot be read."""
    generator = kwargs.get("generator")
    try:
        if generator is not None:
            state = generator.get_state()
        else:
            device = _op_device(args, kwargs)
            if device.type == "cpu":
                state = torch.get_rng_state()
            else:
                state = getattr(torch, device.type).get_rng_state(device)
    except Exception:  # a device module without get_rng_state: no recomputation is recognised there
        return None
    return hashlib.blake2b(state.cpu().numpy().tobytes(), digest_size=16).digest()


def _op_device(args: tuple, kwargs: dict):
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device(kwargs.get("device") or "cpu")


def _mask_index(packet: str) -> int:
    """Which recorded output holds the mask/noise that dropout-like replays need."""
    return 1 if packet == "native_dropout" else 0


class RandomRecorder(IterationMode):
    """Records the values of every random aten op, in order, into `random/` through a `TensorSink`."""

    def __init__(self, sink, group: str = RANDOM, *, inside: Callable[[], str] | None = None):
        super().__init__()
        self.inside = inside  # the compiled block running now, in words ("": none)
        self.num_compiled = 0  # random ops compiled code drew (through aten: `runtime/compiled.py`)
        self.sink = sink
        self.group = group
        self.num_ops = 0
        self.ops: list[str] = []
        self.recorded: list[RecordedOp] = []  # the same, as `RandomReplayer` takes them (paths in `group`)
        self.num_recomputed = 0  # random ops drawn again by activation checkpointing's recomputation
        self._drawn: dict[bytes, int] = {}  # rng_key before a forward random op -> its index
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_higher_order(func) or compiling():  # compiled code's operators, a compiler's own ops (`dispatch.py`)
            return self.pass_on(func, args, kwargs)
        if not is_random(func, args, kwargs):
            return func(*args, **kwargs)
        key = rng_key(args, kwargs)
        result = func(*args, **kwargs)
        if key is not None and in_backward() and key in self._drawn:
            self.num_recomputed += 1  # a recomputation: torch restored the state, these are the same values
            return result
        if key is not None:
            self._drawn.setdefault(key, self.num_ops)
        self.num_compiled += bool(self.inside is not None and self.inside())
        self._record(func, args, result)
        return result

    def _record(self, func, args: tuple, result) -> None:
        values = _random_values(func, args, result)
        with self._lock:
            index = self.num_ops
            self.num_ops += 1
            self.ops.append(str(func))
        paths = []
        for i, tensor in enumerate(values):
            name = f"{index:05d}" if len(values) == 1 else f"{index:05d}.{i}"
            if _packet(func) in _BERNOULLI and tensor.dtype != torch.bool:
                tensor = tensor.ne(0)  # bernoulli draws are 0 or 1: bool is exact and 4x smaller
            attrs = {"op": str(func), "index": index, "output": i}
            self.sink.put(self.group, name, tensor, attrs, dedup=False)
            paths.append(group_path(self.group, name))
        self.recorded.append(RecordedOp(index, str(func), tuple(paths), tuple(tuple(v.shape) for v in values)))

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None:  # on error the recording is aborted anyway; do not mask the error
            self.sink.writer.attrs(self.group, {"num_ops": self.num_ops, "ops": list(self.ops)})
        return result

    pausing = False  # as `RandomReplayer.pausing` (set by `ActiveModes.pause`); a recording's exit checks nothing


@dataclass(frozen=True)
class RecordedOp:
    """One random op of the reference: its full name, and one dataset path and shape per recorded tensor."""

    index: int
    op: str  # "aten.bernoulli_.float"
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def packet(self) -> str:
        return self.op.split(".")[1]


def recorded_random_ops(iteration_file) -> list[RecordedOp]:
    """The reference's random ops in execution order, read from `iteration_file.file` (an open h5py.File).

    A file without the `random` group (recorded without a RandomRecorder) gives an empty list.
    """
    group = iteration_file.file.get(RANDOM)
    if group is None:
        return []
    outputs: dict[int, list[tuple[int, str, tuple[int, ...], str]]] = {}
    for name, dset in group.items():
        head, _, out = name.partition(".")
        op = dset.attrs["op"]
        op = op.decode() if isinstance(op, bytes) else str(op)
        outputs.setdefault(int(head), []).append((int(out or 0), group_path(RANDOM, name), tuple(dset.shape), op))
    ops = []
    for index in sorted(outputs):
        outs = sorted(outputs[index])
        ops.append(RecordedOp(index, outs[0][3], tuple(o[1] for o in outs), tuple(o[2] for o in outs)))
    return ops  # numbered 0..num_ops-1, each with the outputs its op records: `format/consistency.py`


def _shape(shape) -> str:
    return str(list(shape))


def _key_shape(rec: RecordedOp) -> tuple[int, ...]:
    """The shape of the recorded mask/values the replay checks (native_dropout: its mask)."""
    return rec.shapes[_mask_index(rec.packet)]


class RandomReplayer(IterationMode):
    """Replays the reference's random values into the target's random ops, in order.

    `reader` has `.tensor(path)` returning a CPU tensor (an open `IterationFile`); `ops` defaults to
    `recorded_random_ops(reader)`. Recorded tensors are staged on `device` (default: CPU) before being copied.
    On a clean exit, fewer random ops than the reference recorded is an error too.
    """

    def __init__(self, reader, device=None, ops: list[RecordedOp] | None = None, *, replay: bool = True,
                 inside: Callable[[], str] | None = None):
        super().__init__()
        self.inside = inside  # the compiled block running now, in words ("": none), for a mismatch's message
        self.num_compiled = 0  # random ops compiled code drew (through aten: `runtime/compiled.py`), replayed
        self.reader = reader
        self.device = device
        self.ops = list(recorded_random_ops(reader) if ops is None else ops)
        self.replay = replay  # False: count and check the random ops, keep the values this run drew
        self.num_ops = 0
        self.num_recomputed = 0  # random ops drawn again by activation checkpointing's recomputation
        self._drawn: dict[bytes, int] = {}  # rng_key before a forward random op -> its index
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_higher_order(func) or compiling():  # compiled code's operators, a compiler's own ops (`dispatch.py`)
            return self.pass_on(func, args, kwargs)
        if not is_random(func, args, kwargs):
            return func(*args, **kwargs)
        key = rng_key(args, kwargs)
        before = args[0].clone() if _packet(func) in _RRELU and self.replay else None  # rrelu_ overwrites its input
        result = func(*args, **kwargs)  # runs: the target's RNG advances as it would without oneiter
        k = self._drawn.get(key) if key is not None and in_backward() else None
        if k is not None:  # a recomputation of random op k: the values op k was given
            self.num_recomputed += 1
        else:
            with self._lock:
                k = self.num_ops
                self.num_ops += 1
            if key is not None:
                self._drawn.setdefault(key, k)
        rec = self._expect(k, func, _random_values(func, args, result))
        if not self.replay:
            return result
        return self._replay(func, args, kwargs, result, rec, before)

    def _expect(self, k: int, func, values: list) -> RecordedOp:
        """The k-th recorded op, checked against this call: same op (dropout mask kinds agree), same shapes."""
        name = _packet(func)
        shapes = [tuple(v.shape) for v in values]
        got = f"{func} shape {_shape(shapes[_mask_index(name)])}"
        rec = self.ops[k] if k < len(self.ops) else None
        if rec is not None and rec.packet == name:
            ok = list(rec.shapes) == shapes
        else:  # nn.Dropout on a CPU reference vs a device target (or compiled code): same mask, another op
            ok = rec is not None and {rec.packet, name} <= _DROPOUT_MASK and \
                _key_shape(rec) == shapes[_mask_index(name)]
        if ok:
            assert rec is not None  # only a recorded op matches
            self.num_compiled += bool(self.inside is not None and self.inside())
            return rec
        expected = "none" if rec is None else f"{rec.op} shape {_shape(_key_shape(rec))}"
        block = self.inside() if self.inside is not None else ""
        if block:
            raise OneIterError(_own_draws(k, block, got, expected))
        if rec is None:
            raise OneIterError(f"random op #{k}: the reference recorded only {len(self.ops)} random ops, got {got}; "
                               "the target draws random numbers the reference did not (different model or settings?)")
        raise OneIterError(f"random op #{k}: expected {expected} from the reference, got {got}; the random ops differ "
                           "between reference and target (dropout layers, their order, or the batch shape)")

    def _load(self, path: str):
        tensor = self.reader.tensor(path)
        return tensor.to(self.device) if self.device is not None else tensor

    def _replay(self, func, args: tuple, kwargs: dict, result, rec: RecordedOp, before):
        name = _packet(func)
        if name == "native_dropout":
            mask = result[1]
            mask.copy_(self._load(rec.paths[_mask_index(rec.packet)]))
            return dropout_with_mask(args[0], mask, _arg(args, kwargs, 1, "p", 0.5)), mask
        if name in _RRELU:
            noise = args[1]
            noise.copy_(self._load(rec.paths[0]))
            out = before * noise
            if name.endswith("_"):
                return args[0].copy_(out)
            return out
        values = _random_values(func, args, result)
        paths = rec.paths if rec.packet == name else (rec.paths[_mask_index(rec.packet)],)
        # strict=False: another dropout op than the reference's (CPU bernoulli_ vs a fused kernel) has only its mask
        # recorded, replayed into the first of the values
        for value, path in zip(values, paths, strict=False):
            value.copy_(self._load(path))  # copy_ converts dtype (bool mask -> 0./1.) and device
        return result

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None and not self.pausing:
            self.check_complete()
        return result

    pausing = False  # left between two microbatches of one iteration (the Recorder's): more random ops follow

    def check_complete(self) -> None:
        """Every random op the reference recorded was replayed (fewer: the runs differ)."""
        if self.num_ops < len(self.ops):
            k = self.num_ops
            rec = self.ops[k]
            raise OneIterError(f"random op #{k}: expected {rec.op} shape {_shape(_key_shape(rec))} from the "
                               f"reference, got none (the reference recorded {len(self.ops)} random ops, this run "
                               f"{k}); the random ops differ between reference and target")


def _own_draws(k: int, block: str, got: str, expected: str) -> str:
    """The line for a random op compiled code drew otherwise than the reference's (a backend's own generator)."""
    return (f"random op #{k} ran in {block}, whose compiled code drew {got} where the reference drew {expected}: "
            f"the backend draws random numbers of its own, which a replay cannot give the reference's (inductor "
            f"draws through the aten ops oneiter replays when torch._inductor.config.fallback_random is set before "
            f"the graph compiles, as oneiter sets it while it records: a model compiled earlier in the run keeps its "
            f"own draws); set it before the model first runs, turn dropout off on both sides, or leave that module "
            f"uncompiled")


def dropout_with_mask(input, mask, p: float):
    """What `aten.native_dropout` computes for a given mask: `input * (mask * scale)`, scale = 1/(1-p).

    Checked bitwise against the CPU kernel (torch 2.13) for float32, float64, bfloat16 and float16; the
    grouping matters for the half types (`input * mask * scale` rounds twice).
    """
    p1m = 1.0 - p
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    return input * (mask.to(input.dtype) * scale)
