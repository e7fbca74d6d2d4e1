"""Every aten op of one layer call, measured by its *own* error: rerun alone, on exactly its own inputs, in float64 on
the CPU, next to the expected noise of its precision.

Where this sits: `layer_replay.trace_layer` runs one recorded call (forward, then backward from the recorded output
gradients, strides as recorded, random ops with the reference's values) under an `OpTracer`, a TorchDispatchMode.
Dispatch modes sit below autograd and autocast, so the tracer sees every aten op the call dispatches, forward and
backward, in execution order, in the dtypes autocast chose, on the target's device with the target's kernels. For
each op it:

1. copies the op's inputs to the host *before* the op runs (an in-place op overwrites them), then runs the op as it
   is and hands its result on unchanged;
2. reruns the op on those copies on the CPU in float64 (floating tensors and floating `dtype` arguments widened,
   `device` arguments the CPU): the op's own error is rel_l2 of its output against that, so no upstream op's error
   counts. An op the CPU cannot run in float64 is rerun through its decomposition (`torch._decomp`), else in float32
   (a bf16/fp16 op), else in its own dtypes on the CPU (`OpRow.reference` says which);
3. measures the op's expected noise when that error exceeds one unit roundoff of the op's precision (below it
   nothing can be flagged), as the layer blame's calibration does (`probe.py`): the CPU's own error, the op rerun
   on the CPU in its own dtypes against the higher-precision rerun, never below one unit roundoff. The op's
   precision is the coarsest of its floating outputs' dtypes, or the reduced mode this process runs its family in
   (TF32 matmuls and convolutions: `precision_modes`), whose float32 operands the CPU rerun then rounds the same
   way (`reduced.OPERANDS`). Where no higher precision ran, or the CPU has no kernel in the op's dtypes, the noise
   is the layer blame's fallback (`montecarlo.py`): `SAMPLES` reruns with every floating input perturbed at that
   roundoff (`rerun.Perturbation`, the same seeds), their spread around the unperturbed rerun times `OP_SCALE`.

Like every calibration these reruns are trusted recomputations (`record/modes/trusted.py`): an op whose CPU kernel is
not torch's own (a plugin's `torch.library` registration, a C++ extension's kernel over torch's) is rerun through
torch's own kernel of another overload, its composite kernel or its decomposition (else its own kernel in float64,
rounded to its dtype), in float64 and in its own dtypes alike; the row's note says so. So a wrong CPU kernel — the
target's own, when the target runs on the CPU — is measured against torch's, never against itself.

What the tracer does not judge (the row says why): random ops (they take the reference's values), views, ops with
uninitialized outputs (`empty`) and ops without a tensor output. Integer and bool outputs must equal the rerun's.
The first row the caller's `keep` accepts keeps its inputs and outputs (`OpCase`): the reproducer of `--repro`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import sysconfig
import types
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from oneiter.record.local.emulate import scaled_mm
from oneiter.record.local.montecarlo import MONTE_CARLO, OP_SCALE, SAMPLES, SEED, spread
from oneiter.record.local.reduced import OPERANDS
from oneiter.record.local.rerun import Perturbation, tensor_stats
from oneiter.record.modes import trusted
from oneiter.record.modes.randomness import is_random
from oneiter.record.modes.roundoff_mode import COPIES, UNINITIALIZED
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.precision_modes import FAMILY_OPS, MANTISSA_BITS, round_mantissa

__all__ = ["OpRow", "OpCase", "OpTracer", "RANDOM_NOTE", "OWN_DTYPES", "UNIT_ROUNDOFF", "op_name"]

RANDOM_NOTE = "random: the reference's values"
OWN_DTYPES = "cpu, the op's own dtypes"  # `OpRow.reference` of an op no higher precision ran
UNIT_ROUNDOFF = "unit roundoff"  # `OpRow.noise_from` when the error, or the calibration, is within one
EXACT_SCALED = "cpu float64 (exact scaled product)"  # `OpRow.reference` of a float8 `_scaled_mm`
# ops that move, cast or copy values without computing new ones (left out of the op sequence
# `judge.replayed.op_verdict` compares), and ops with uninitialized outputs: `record/modes/roundoff_mode.py`'s
_COPIES, _UNINITIALIZED = COPIES, UNINITIALIZED
# frames that are no user's code: torch's, oneiter's, the standard library's
_NOT_USER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
             sysconfig.get_paths()["stdlib"] + os.sep, "<")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def op_name(func) -> str:
    """`aten::silu`, `aten::add.Tensor`: the op's schema name, with its overload unless it is the default one."""
    return func.name()


@dataclass
class OpRow:
    """One dispatched op: what it was, where it was called from, and its own error next to its expected noise."""

    index: int
    op: str
    phase: str
    shapes: list = field(default_factory=list)
    """The shape of each tensor argument, in argument order (lists of tensors flattened)."""
    dtypes: list = field(default_factory=list)
    strides: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    """Each tensor argument's storage offset (elements)."""
    line: str = ""
    """The user's line that called it (`file:line in function`); in backward, the line of the forward op whose
    autograd node this op belongs to."""
    node: str = ""
    """In backward: the autograd node that ran it (`SiluBackward0`)."""
    computes: bool = True
    """False for views, casts and copies: no new values (left out of the sequence comparison)."""
    rel_l2: float | None = None
    """Its own error: rel_l2 of its output against the CPU rerun (the worst floating output); None: not judged."""
    noise: float | None = None
    """Its expected noise (at least one unit roundoff of its precision)."""
    roundoff: float | None = None
    reference: str = ""
    """What the op was rerun as: `cpu float64`, `cpu float64 (decomposition)`, `cpu float32`, or `OWN_DTYPES` (the
    CPU in the op's own dtypes: no higher precision ran)."""
    noise_from: str = ""
    """`cpu` (the CPU's own error in the op's dtypes), `monte_carlo`, or `unit roundoff` when the error or that
    estimate was within one."""
    mismatch: int = 0
    """Positions whose NaN/Inf differ from the rerun's, or integer/bool elements that differ."""
    note: str = ""
    """Why the op is not judged (random, view, uninitialized), or how it was."""

    @property
    def judged(self) -> bool:
        return self.rel_l2 is not None

    @property
    def ratio(self) -> float | None:
        if self.rel_l2 is None or not self.noise:
            return None
        return self.rel_l2 / self.noise


@dataclass
class OpCase:
    """One op with everything needed to run it again (`--repro`): its callable, arguments with host copies of the
    tensors as they were before it ran, each tensor argument's live layout, what the target produced and what the
    CPU rerun gave."""

    row: OpRow
    func: Any
    args: tuple
    kwargs: dict
    layouts: dict
    """id of each host copy in `args`/`kwargs` -> (stride, storage offset) of the tensor the op was given."""
    produced: list
    """The target's tensor outputs, on the host, in its dtypes."""
    expected: list
    """The rerun's tensor outputs (float64 where the op ran in float64)."""


class OpTracer(TorchDispatchMode):
    """Runs and measures every aten op dispatched while it is active (module docstring). `keep(row)`: whether the
    row's op is the one to keep as an `OpCase` (the first accepted is). `reduced`: {family: mode} of the float32 op
    families this process runs reduced (TF32), which widens their roundoff."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # an eager-only mode: no dynamo import (see randomness.RandomRecorder)

    def __init__(self, *, keep: Callable[[OpRow], bool] = lambda row: False, reduced: dict | None = None):
        super().__init__()
        self.keep = keep
        self.rows: list[OpRow] = []
        self.case: OpCase | None = None
        self.phase = "forward"
        # aten op -> the explicit mantissa bits its float32 operands keep in this process (TF32: 10)
        self._bits = {op: MANTISSA_BITS[mode] for family, mode in (reduced or {}).items() for op in FAMILY_OPS[family]}

    @contextmanager
    def watching(self, phase: str) -> Iterator[None]:
        """Trace the block as `phase`; in forward with anomaly detection on, so that each autograd node keeps the
        stack that created it (the backward rows' `line`)."""
        self.phase = phase
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            anomaly = torch.autograd.detect_anomaly(check_nan=False) if phase == "forward" else nullcontext()
            with anomaly, self:
                yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):
            # a tensor subclass's op (torchao's Float8TrainingTensor, a DTensor) is the subclass's to dispatch: the
            # tracer sees the ops on plain tensors it runs (the float8 casts, `_scaled_mm`)
            return NotImplemented
        kwargs = kwargs or {}
        row = self._describe(func, args, kwargs)
        packet = func.overloadpacket.__name__
        if is_random(func, args, kwargs):
            row.note = RANDOM_NOTE
            self.rows.append(row)
            return func(*args, **kwargs)
        if func.is_view or packet in _UNINITIALIZED:
            row.computes, row.note = False, "view" if func.is_view else "uninitialized values"
            self.rows.append(row)
            return func(*args, **kwargs)
        row.computes = packet not in _COPIES
        layouts: dict[int, tuple] = {}

        def host_copy(x):  # before the op: an in-place op overwrites its inputs
            copy = _host(x)
            if isinstance(x, torch.Tensor):
                layouts[id(copy)] = (list(x.stride()), int(x.storage_offset()))
            return copy

        host = tree_map(host_copy, (args, kwargs))
        result = func(*args, **kwargs)
        outputs = _tensors(result)
        if not outputs:
            row.computes, row.note = False, "no tensor output"
        else:
            produced = [_host(t) for t in outputs]
            expected = self._measure(row, func, host, produced)
            if expected is not None and self.case is None and self.keep(row):
                self.case = OpCase(row, func, host[0], host[1], layouts, produced, expected)
        self.rows.append(row)
        return result

    # -- describing ---------------------------------------------------------------------------------------------
    def _describe(self, func, args: tuple, kwargs: dict) -> OpRow:
        tensors = _tensors((args, kwargs))
        row = OpRow(len(self.rows), op_name(func), self.phase, [list(t.shape) for t in tensors],
                    [str(t.dtype).removeprefix("torch.") for t in tensors], [list(t.stride()) for t in tensors],
                    [int(t.storage_offset()) for t in tensors])
        if self.phase == "forward":
            row.line = _user_line_here()
        else:
            node = torch._C._current_autograd_node()
            if node is not None:
                row.node = node.name()
                # torch types Node.metadata as a method; an autograd node's is a dict attribute
                row.line = _user_line_in(node.metadata.get("traceback_") or [])  # type: ignore[attr-defined]
        return row

    # -- measuring ----------------------------------------------------------------------------------------------
    def _measure(self, row: OpRow, func, host: tuple, produced: list) -> list | None:
        """Set the row's error and noise; return the rerun's outputs (None: the op could not be rerun)."""
        row.roundoff = self._roundoff(func, produced)
        if func.overloadpacket.__name__ == "_scaled_mm" and len(produced) == 1:
            emulated = scaled_mm(*host[0], **host[1], device_type=produced[0].device.type)
            if emulated is not None:  # float8 operands: the exact product, judged as a recipe's product is
                row.reference, row.noise_from = EXACT_SCALED, "accumulation"
                row.rel_l2, row.mismatch = emulated.deviation(produced[0]), 0
                row.noise = max(emulated.noise(), unit_roundoff("float32"))
                return [emulated.center]
        since = trusted.mark()
        with torch.no_grad(), torch.autocast("cpu", enabled=False), trusted.running():
            found = _rerun(func, host, row.roundoff)
            if found is None:
                row.note = "not judged: no CPU run of this op"
                return None
            expected, row.reference, run = found
            errors = _errors(expected, produced)
            if errors is None:
                row.note = "not judged: the CPU rerun's outputs differ in number or shape"
                return None
            row.rel_l2, row.mismatch = errors
            noise, how = None, UNIT_ROUNDOFF
            if row.rel_l2 > row.roundoff:  # below one unit roundoff nothing can be flagged: no calibration
                noise, how = self._noise(func, run, host, produced, expected, row.reference)
            row.noise, row.noise_from = (noise, how) if noise is not None and noise > row.roundoff else (
                row.roundoff, UNIT_ROUNDOFF)
        if op_name(func) in trusted.met_since(since):
            row.note = f"its CPU kernel is not torch's own: rerun through {trusted.route_for(func).label}"
        return expected

    def _noise(self, func, run, host: tuple, produced: list, expected: list, reference: str) -> tuple:
        """(noise, how): the CPU's own error in the op's dtypes against the higher-precision rerun (the layer
        blame's calibration; operands rounded to this process's reduced mode for TF32 families), else a Monte Carlo
        estimate (`montecarlo.py`) where no higher precision or no CPU kernel in these dtypes ran."""
        if reference != OWN_DTYPES:
            bits = self._bits.get(func.overloadpacket.__name__)
            for candidate in dict.fromkeys((func, run)):
                low = _run_low(candidate, host, bits, func.overloadpacket.__name__)
                errors = _errors(expected, low) if low is not None else None
                if errors is not None:
                    return errors[0], "cpu"
        return _monte_carlo(run, host, produced, self._roundoff(func, produced)), MONTE_CARLO

    def _roundoff(self, func, produced: list) -> float:
        """The unit roundoff of the op's precision: its coarsest floating output, or its family's reduced mode."""
        floats = [unit_roundoff(str(t.dtype)) for t in produced if t.is_floating_point()]
        base = max(floats) if floats else unit_roundoff("float64")
        bits = self._bits.get(func.overloadpacket.__name__)
        if bits is not None and any(t.dtype == torch.float32 for t in produced):
            base = max(base, 2.0 ** -(bits + 1))
        return base


# -- reruns ---------------------------------------------------------------------------------------------------------
def _rerun(func, host: tuple, roundoff: float) -> tuple[list, str, Callable] | None:
    """(outputs, what they are, the callable that gave them) of the highest-precision CPU rerun that runs."""
    attempts: list[tuple[Any, Any, str]] = [(func, torch.float64, "cpu float64")]
    decomposition = _decomposition(func)
    if decomposition is not None:
        attempts.append((decomposition, torch.float64, "cpu float64 (decomposition)"))
    if roundoff > unit_roundoff("float32"):
        attempts.append((func, torch.float32, "cpu float32"))
    attempts.append((func, None, OWN_DTYPES))
    for run, dtype, label in attempts:
        args, kwargs = tree_map(lambda x, dt=dtype: _widened(x, dt), host)
        try:
            return _tensors(run(*args, **kwargs)), label, run
        except Exception:  # noqa: BLE001 - no kernel for this dtype or device: try the next
            continue
    return None


def _run_low(run: Callable, host: tuple, bits: int | None, packet: str) -> list | None:
    """The op on the CPU in its own dtypes (float32 operands of a reduced family rounded to `bits`), or None."""
    args, kwargs = tree_map(_copy, host)
    if bits is not None:
        args = [round_mantissa(a, bits) if i in OPERANDS.get(packet, ()) and isinstance(a, torch.Tensor) else a
                for i, a in enumerate(args)]
    try:
        return _tensors(run(*args, **kwargs))
    except Exception:  # noqa: BLE001 - no CPU kernel in these dtypes
        return None


def _decomposition(func):
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)


def _monte_carlo(run: Callable, host: tuple, produced: list, roundoff: float) -> float | None:
    """The op's noise: `SAMPLES` reruns in its own dtypes on the CPU, floating inputs perturbed (`montecarlo.py`);
    the worst output's spread. None when the op does not run on the CPU in its own dtypes."""
    try:
        base = _tensors(run(*tree_map(_copy, host[0]), **tree_map(_copy, host[1])))
        samples = []
        for k in range(SAMPLES):
            perturb = Perturbation((SEED + k, roundoff))
            args, kwargs = tree_map(lambda x, p=perturb: p(x.clone()) if isinstance(x, torch.Tensor) else x, host)
            samples.append(_tensors(run(*args, **kwargs)))
    except Exception:  # noqa: BLE001 - no CPU kernel in this dtype
        return None
    noises = [spread(b, [s[i] for s in samples], OP_SCALE) for i, b in enumerate(base)
              if b.is_floating_point() and i < len(produced) and produced[i].is_floating_point()]
    return max(noises) if noises else None


def _errors(expected: list, produced: list) -> tuple[float, int] | None:
    """(worst rel_l2 of a floating output, number of mismatching positions) of the target's outputs against the
    rerun's; None when they do not pair up."""
    if len(expected) != len(produced):
        return None
    worst, mismatch = 0.0, 0
    for want, got in zip(expected, produced, strict=True):
        if tuple(want.shape) != tuple(got.shape):
            return None
        if want.is_complex() and got.is_complex():  # compared as (real, imaginary) pairs
            want, got = torch.view_as_real(want.resolve_conj()), torch.view_as_real(got.resolve_conj())
        if got.is_floating_point() and want.is_floating_point():
            stats = tensor_stats(want, got) if got.numel() else {"rel_l2": 0.0, "mismatch": 0}
            worst, mismatch = max(worst, stats["rel_l2"]), mismatch + int(stats["mismatch"])
        elif got.numel():
            mismatch += int((want.to(got.dtype) != got).sum())
    return (worst if math.isfinite(worst) else math.inf), mismatch


# -- values ---------------------------------------------------------------------------------------------------------
def _tensors(tree) -> list:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _host(x):
    """A detached CPU copy of a tensor (its dtype kept); anything else as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().to("cpu", copy=True)


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _widened(x, dtype):
    """An argument for a CPU rerun in `dtype` (None: as it is): floating tensors and floating dtype arguments in
    `dtype`, devices the CPU; always a fresh tensor (an in-place op may write into it)."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if dtype is not None and x.is_floating_point() and x.dtype != dtype else x.clone()
    if isinstance(x, torch.dtype):
        return dtype if dtype is not None and x.is_floating_point else x
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


# -- where an op was called from ------------------------------------------------------------------------------------
def _user_line_here() -> str:
    """The innermost frame of the current stack that is no torch, oneiter or standard-library code."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_NOT_USER):
            return f"{_short(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def _user_line_in(stack: list) -> str:
    """The same for a stack anomaly detection saved with an autograd node (formatted frames, outermost first)."""
    for entry in reversed(stack):
        match = _FRAME.search(str(entry))
        if match and not match["file"].startswith(_NOT_USER):
            return f"{_short(match['file'])}:{match['line']} in {match['func']}"
    return ""


def _short(path: str) -> str:
    """A path as a reader wants it: relative to the working folder, or from the installed package's folder."""
    head, sep, tail = path.rpartition("site-packages" + os.sep)
    if sep:
        return tail
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative
