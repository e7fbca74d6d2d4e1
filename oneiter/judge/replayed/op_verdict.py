"""`oneiter replay REF --layer PATH --ops`: which kernel inside the culprit, or whether the program itself differs.

Where this sits: `record.replay.layer_replay.trace_layer` runs the recorded call once on the target's stack under an
`record.replay.op_rerun.OpTracer` (each aten op rerun alone on its own inputs in float64 on the CPU, with its expected
noise), then again on the CPU in float64; this module judges that, once, for every report (terminal, `--json`, the HTML
page of `compare --drill`):

- **an op** is flagged when its own error exceeds `factor` (4, the layer blame's) times its expected noise, or when
  NaN/Inf (or integer outputs) differ from its rerun's; the **culprit** is the first flagged op in execution order
  (forward, then backward).
- **the program** is flagged when the layer's own code, computed exactly (the float64 run: the same Python code, so
  a replaced function, a patched class, an extra scale are in it), does not give the reference's recorded outputs,
  input gradients and parameter gradients: rel_l2(recorded, exact) above `factor` x what rounding explains, the
  target run's distance to the exact one (and the recording's precision's, when coarser), at least one unit
  roundoff. No kernel is wrong then: the *program* is. Where the reference's op sequence for the layer is at hand
  (`--reference-ops`: the `--json` of the same command run on the reference's stack, validated on reading), the
  stretches where the two sequences part are listed (views, casts and copies left out).

Exit code (`OpsResult.exit_code`): 1 when an op or the program is flagged, 0 when neither is.

`drill` is `compare --drill`: the same for the culprit call of a comparison, when the target's stack is on this
machine (its device resolves here, its model can be built); otherwise the `oneiter replay ... --ops` command to run
there.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oneiter.errors import DeviceError, FormatError, OneIterError
from oneiter.format.layout import IterationFile
from oneiter.format.schema import FOREIGN_KERNELS, ROOT_MODULE, call_key, decode
from oneiter.judge.iteration.engine import foreign_notes
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.measure.metrics import compare_arrays
from oneiter.judge.measure.tolerance import NoisePolicy
from oneiter.record.modes import trusted
from oneiter.record.replay.layer_replay import RECORDED, LayerTrace, trace_layer
from oneiter.record.replay.op_repro import repro_folder, write_repro
from oneiter.record.replay.op_rerun import RANDOM_NOTE, OpRow, OpTracer
from oneiter.runtime.commands import replay_ops_command
from oneiter.runtime.devices import resolve_device
from oneiter.runtime.modelspec import is_file_spec
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.precision_modes import current, reduced

__all__ = ["OpsResult", "ProgramTensor", "Departure", "Drill", "replay_ops", "drill", "flagged",
           "read_reference_ops", "FORMAT", "MAX_REFERENCE_BYTES"]

FORMAT, VERSION = "oneiter.ops", 1  # the `--json` document; also what `--reference-ops` reads
MAX_REFERENCE_BYTES = 256 * 2**20
_OP_NAME = re.compile(r"[A-Za-z0-9_]+::[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?")
_MAX_DEPARTURES = 5


def flagged(row: OpRow, factor: float) -> bool:
    """An op above `factor` x its expected noise, or with NaN/Inf (or integer values) other than its rerun's."""
    return row.judged and (row.mismatch > 0 or (row.ratio is not None and row.ratio > factor))


@dataclass(frozen=True)
class ProgramTensor:
    """One of the layer's recorded tensors against its own program computed exactly."""

    name: str
    program: float
    """rel_l2 of the reference's recorded tensor against the layer's code run in float64 on the CPU."""
    explained: float
    """What rounding explains: the traced run's rel_l2 to the exact one (the coarser recording's, when larger)."""
    floor: float
    ratio: float
    flagged: bool


@dataclass(frozen=True)
class Departure:
    """A stretch where the target's op sequence parts from the reference's (computing ops only)."""

    phase: str
    kind: str
    """`insert` (ops only the target runs), `delete` (only the reference), `replace` (other ops)."""
    reference: list
    target: list
    index: int | None
    """The target's first op of the stretch (its row), or the op after a deletion; None at the end."""
    line: str


@dataclass
class OpsResult:
    """What `replay_ops` found. `rows`: every dispatched op in execution order; `culprit`: the first flagged;
    `program`: the layer's tensors against its program computed exactly; `departures`: None without the
    reference's sequence."""

    recording: str
    key: str
    class_name: str
    device: str
    dtype: str
    amp: str | None
    factor: float
    rows: list[OpRow]
    program: list[ProgramTensor]
    departures: list[Departure] | None = None
    notes: list[str] = field(default_factory=list)
    repro: list[str] = field(default_factory=list)
    """The files `--repro` wrote."""

    @property
    def culprit(self) -> OpRow | None:
        return next((r for r in self.rows if flagged(r, self.factor)), None)

    @property
    def program_flagged(self) -> bool:
        return any(t.flagged for t in self.program)

    @property
    def exit_code(self) -> int:
        return 1 if self.culprit is not None or self.program_flagged else 0

    @property
    def judged(self) -> list[OpRow]:
        return [r for r in self.rows if r.judged]

    def headline(self) -> str:
        c, judged = self.culprit, self.judged
        if c is not None:
            return (f"DIVERGED: {c.op} ({c.phase}, op #{c.index} of {self.key}) is the first op above its expected "
                    f"noise: {_own(c)}")
        if self.program_flagged:
            worst = next(t for t in self.program if t.flagged)
            return (f"DIVERGED (program): no op of {self.key} is above its expected noise ({len(judged)} judged), "
                    f"yet its own code computed exactly gives another {worst.name} than the reference's: rel_l2 "
                    f"{worst.program:.2e}, where rounding explains {max(worst.explained, worst.floor):.2e}: the "
                    f"program differs, not a kernel")
        top = max(judged, key=lambda r: r.ratio or 0.0, default=None)
        where = f", highest {top.ratio:.1f}x at {top.op} ({top.phase}, #{top.index})" if top and top.ratio else ""
        program = "its program gives the reference's tensors" if self.program else "its program was not checked"
        return (f"MATCH: no op of {self.key} is above its expected noise x{self.factor:g} ({len(judged)} ops "
                f"judged{where}), and {program}")

    def lines(self) -> list[str]:
        """Headline, then where the culprit was called, the program check and the sequence comparison."""
        lines = [self.headline()]
        c = self.culprit
        if c is not None:
            called = f"called at {c.line}" if c.line else "called from no line outside torch"
            node = f" (in backward: {c.node}, for the forward op at that line)" if c.node else ""
            lines.append(f"  {called}{node}; inputs {_shapes(c)}; rerun as {c.reference}")
        if self.program_flagged and c is not None:
            lines.append("  the layer's program differs from the reference's too: "
                         + ", ".join(t.name for t in self.program if t.flagged))
        lines.extend(self._sequence_lines())
        lines.extend(f"note: {n}" for n in self.notes)
        return lines

    def _sequence_lines(self) -> list[str]:
        if self.departures is None:
            if self.program_flagged:
                return ["  where the op sequence departs: the reference's sequence is not at hand; run the same "
                        "command on the reference's machine with --json FILE and pass FILE as --reference-ops"]
            return []
        if not self.departures:
            return ["  the op sequence is the reference's (views, casts and copies aside)"]
        first = self.departures[0]
        text = [f"  the op sequence departs from the reference's in {len(self.departures)} stretch(es); first: "
                f"{_departure(first)}"]
        text += [f"    then: {_departure(d)}" for d in self.departures[1:_MAX_DEPARTURES]]
        return text

    def as_dict(self) -> dict[str, Any]:
        """The `--json` document: `culprit` (the first flagged op, null when none) and every row with `flagged`."""
        c = self.culprit
        return _finite({
            "format": FORMAT, "version": VERSION, "recording": self.recording, "key": self.key,
            "class_name": self.class_name, "device": self.device, "dtype": self.dtype, "amp": self.amp,
            "factor": self.factor, "status": "diverged" if self.exit_code else "match", "headline": self.headline(),
            "details": self.lines()[1:], "exit_code": self.exit_code,
            "culprit": None if c is None else _row_dict(c, self.factor),
            "program": {"flagged": self.program_flagged, "tensors": [asdict(t) for t in self.program],
                        "departures": None if self.departures is None else [asdict(d) for d in self.departures]},
            "num_ops": len(self.rows), "num_judged": len(self.judged),
            "num_flagged": sum(flagged(r, self.factor) for r in self.rows),
            "ops": [_row_dict(r, self.factor) for r in self.rows], "notes": list(self.notes), "repro": self.repro,
        })


def replay_ops(
    path: str | Path, layer: str, *, call: int = 0, device: str = "cpu", dtype: str | None = None,
    amp: str | None = RECORDED, model: str | None = None, reference_ops: str | Path | None = None,
    repro: str | Path | None = None, factor: float | None = None, compile: str | None = None,
    float8: str | None = None,
) -> OpsResult:
    """Trace call `call` of `layer` of the recording at `path` op by op on `device` (this process's stack: its
    plugins, its patched functions) and judge it (module docstring). `reference_ops`: the reference side's `--json`
    of the same call, to show where the op sequences part; `repro`: a folder for the culprit op's reproducer
    (written only when an op is flagged). A compiled layer (`compile`, or one the model compiles itself) is judged
    by the nodes of its compiled graphs (`record/replay/graph_ops.py`). The other arguments are `run_layer`'s."""
    factor = NoisePolicy().factor if factor is None else factor
    folder = repro_folder(repro) if repro is not None else None  # refused before anything runs
    reference = read_reference_ops(reference_ops) if reference_ops is not None else None
    key = call_key("" if layer == ROOT_MODULE else layer, call)
    if reference is not None and reference["key"] != key:
        raise OneIterError(f"--reference-ops traced {reference['key']}, not {key}")
    tracer = OpTracer(keep=lambda row: flagged(row, factor), reduced=reduced(current(device.strip().split(":")[0])))
    since = trusted.mark()
    trace = trace_layer(path, layer, tracer, call=call, device=device, dtype=dtype, amp=amp, model=model,
                        compile=compile, float8=float8)
    run, tracer = trace.run, trace.tracer
    kernels = foreign_notes({FOREIGN_KERNELS: json.dumps({"cpu": trusted.met_kernels(since)})})
    result = OpsResult(recording=str(path), key=run.key, class_name=run.class_name, device=run.device,
                       dtype=run.dtype, amp=run.amp, factor=factor, rows=tracer.rows, program=[],
                       notes=[*run.notes, *kernels])
    if trace.random_values:
        result.program = _program(path, trace, factor)
    else:
        result.notes.append("the program is not checked: the recording holds no values for the call's random ops")
    if not trace.grads_comparable:
        result.notes.append("gradients are left out of the program check (recorded output gradients are totals)")
    if reference is not None and isinstance(tracer, OpTracer):
        result.departures = departures(reference["ops"], tracer.rows)
    elif reference is not None:
        result.notes.append("--reference-ops lists aten ops; a compiled layer shows graph nodes: not compared")
    if folder is not None:
        result.repro = _repro(folder, tracer, result)
    return result


def _repro(folder: Path, tracer: OpTracer, result: OpsResult) -> list[str]:
    case = tracer.case
    if case is None:
        result.notes.append("--repro: no op is flagged, so there is no op to reproduce; nothing written")
        return []
    meta = {"device": result.device, "layer": result.key, "recording": result.recording}
    assert case.row.noise is not None  # the case kept is a flagged op, so judged: its noise is set
    return [str(p) for p in write_repro(folder, case, noise=case.row.noise, factor=result.factor, meta=meta)]


# -- compare --drill -----------------------------------------------------------------------------------------------
@dataclass
class Drill:
    """`compare --drill`: the culprit call, the command that traces it op by op, and its result where it ran here
    (`ops` None: `why_not`)."""

    layer: str
    call: int
    command: str
    ops: OpsResult | None = None
    why_not: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "call": self.call, "command": self.command, "why_not": self.why_not,
                "ops": None if self.ops is None else self.ops.as_dict()}


def drill(result: CompareResult, *, model: str | None = None) -> Drill | None:
    """The op-level report of `result`'s culprit call, run on the target's device, dtype and autocast with this
    process's stack; None when the verdict names no module call (no culprit, or one of a parameter update)."""
    culprit = result.culprit
    if culprit is None or culprit.phase not in ("forward", "backward"):
        return None
    meta = result.meta_target
    device, dtype, amp = str(meta.get("device") or "cpu"), meta.get("dtype") or None, meta.get("amp") or None
    float8 = meta.get("float8") or None  # `record --float8`: the target's Linears in torchao's float8
    recorded = str(meta.get("model") or "")
    spec = model or recorded
    # a culprit that is a compiled block of the target: traced compiled with its backend (graph nodes)
    blocks = ((result.compiled or {}).get("target") or {}).get("blocks") or {}
    block = blocks.get("" if culprit.module == ROOT_MODULE else culprit.module)
    backend = str(block.get("backend") or "") if isinstance(block, dict) else ""
    named = spec if spec and (model or is_file_spec(spec)) else None  # a built-in one is the recording's default
    command = replay_ops_command(result.reference, culprit.module, culprit.call, device=device, dtype=dtype, amp=amp,
                                 model=named, compile=backend or None, float8=float8)
    found = Drill(layer=culprit.module, call=culprit.call, command=command)
    if is_file_spec(spec) and model is None:
        found.why_not = "the target's model is a file: name it with --model (a recording never chooses the code)"
        return found
    try:
        resolve_device(device)
    except DeviceError as exc:
        found.why_not = f"the target's device is not on this machine: {exc}"
        return found
    try:
        found.ops = replay_ops(result.reference, culprit.module, call=culprit.call, device=device, dtype=dtype,
                               amp=amp, model=model, compile=backend or None, float8=float8)
    except OneIterError as exc:  # the comparison's verdict stands; the drill says why it could not run
        found.why_not = f"the drill failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return found


# -- the program check ----------------------------------------------------------------------------------------------
def _program(path, trace: LayerTrace, factor: float) -> list[ProgramTensor]:
    """Each recorded tensor of the call against the layer's code computed exactly (module docstring)."""
    exact, target = trace.produced["float64"], trace.produced["target"]
    coarse = trace.produced.get("reference", {})
    out = []
    with IterationFile(path) as ref:
        for name, dataset in trace.recorded.items():
            if name.startswith(("grad_input", "param_grad")) and not trace.grads_comparable:
                continue
            if exact.get(name) is None or target.get(name) is None:
                continue
            recorded_dtype = ref.dtype_of(dataset)
            recorded = ref.read(dataset)
            program = _rel_l2_to_exact(exact[name], recorded)
            coarse_error = _rel_l2_to_exact(exact[name], _values(coarse[name])) if coarse.get(name) is not None else 0.0
            explained = max(_rel_l2_to_exact(exact[name], _values(target[name])), coarse_error)
            floor = max(unit_roundoff(recorded_dtype), unit_roundoff(target[name][1]))
            ratio = program / max(explained, floor)
            out.append(ProgramTensor(name=name, program=program, explained=explained, floor=floor, ratio=ratio,
                                     flagged=ratio > factor))
    return out


def _values(produced: tuple[np.ndarray, str]) -> np.ndarray:
    array, dtype = produced
    return decode(array, dtype)


def _rel_l2_to_exact(exact: tuple[np.ndarray, str], other: np.ndarray) -> float:
    """rel_l2 of `other` against the exact (float64) values, over the positions finite on both sides."""
    reference = _values(exact)
    if reference.shape != other.shape:
        return math.inf
    return compare_arrays(reference, other, atol=0.0, rtol=0.0).rel_l2


# -- the op sequences -----------------------------------------------------------------------------------------------
def _sequence(rows: list, phase: str) -> list[tuple[str, int | None, str]]:
    """(name, row index, line) of the computing ops of `phase`; random ops under one name (a CPU reference's
    bernoulli_ and a device's native_dropout are the same dropout)."""
    return [("(random op)" if r.get("note") == RANDOM_NOTE else r["op"], r.get("index"), r.get("line") or "")
            for r in rows if r["phase"] == phase and r.get("computes", True)]


def departures(reference: list[dict], rows: list[OpRow]) -> list[Departure]:
    """Where the target's op sequence parts from the reference's, per phase (difflib's opcodes)."""
    mine = [asdict(r) for r in rows]
    found = []
    for phase in ("forward", "backward"):
        theirs, ours = _sequence(reference, phase), _sequence(mine, phase)
        matcher = difflib.SequenceMatcher(a=[t[0] for t in theirs], b=[o[0] for o in ours], autojunk=False)
        for kind, a0, a1, b0, b1 in matcher.get_opcodes():
            if kind == "equal":
                continue
            at = ours[b0] if b0 < len(ours) else None
            found.append(Departure(phase=phase, kind=kind, reference=[t[0] for t in theirs[a0:a1]],
                                   target=[o[0] for o in ours[b0:b1]], index=at[1] if at else None,
                                   line=at[2] if at else ""))
    return found


def read_reference_ops(path: str | Path) -> dict[str, Any]:
    """The `--json` of `replay --ops` run on the reference's stack, checked before use: a regular file of at most
    `MAX_REFERENCE_BYTES`, this format and version, a call key, and rows each with an op name, a phase, a computes
    flag and (optionally) a line and a note; anything else is a one-line FormatError (exit 2)."""
    path = Path(path)
    try:
        if not path.is_file():
            raise FormatError(f"--reference-ops '{path}': not a regular file")
        if os.path.getsize(path) > MAX_REFERENCE_BYTES:
            raise FormatError(f"--reference-ops '{path}': larger than {MAX_REFERENCE_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"--reference-ops '{path}' cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise FormatError(f"--reference-ops '{path}' is not the --json of `oneiter replay --ops` ({FORMAT} "
                          f"version {VERSION})")
    if not isinstance(data.get("key"), str) or not isinstance(data.get("ops"), list):
        raise FormatError(f"--reference-ops '{path}': expected a string 'key' and a list 'ops'")
    return {"key": data["key"], "ops": [_checked_row(row, i, path) for i, row in enumerate(data["ops"])]}


def _checked_row(row: Any, i: int, path: Path) -> dict[str, Any]:
    ok = (isinstance(row, dict) and isinstance(row.get("op"), str) and _OP_NAME.fullmatch(row["op"])
          and row.get("phase") in ("forward", "backward") and isinstance(row.get("computes"), bool)
          and isinstance(row.get("line", ""), str) and len(row.get("line", "")) <= 4096
          and isinstance(row.get("note", ""), str) and len(row.get("note", "")) <= 4096)
    if not ok:
        raise FormatError(f"--reference-ops '{path}': op row {i} is not a row of `replay --ops` (op name, phase "
                          "forward/backward, computes true/false)")
    return {"op": row["op"], "phase": row["phase"], "computes": row["computes"], "line": row.get("line", ""),
            "note": row.get("note", ""), "index": None}


# -- text -----------------------------------------------------------------------------------------------------------
def _own(row: OpRow) -> str:
    if row.mismatch:
        return f"{row.mismatch} elements whose NaN/Inf or integer values differ from its rerun's"
    return (f"its own error rel_l2 {row.rel_l2:.2e}, on exactly its own inputs, is {row.ratio:.1f}x its expected "
            f"noise {row.noise:.2e}")


def _shapes(row: OpRow) -> str:
    parts = [f"{'x'.join(map(str, s)) or 'scalar'} {d} stride {tuple(st)}"
             for s, d, st in zip(row.shapes, row.dtypes, row.strides, strict=True)]
    return "; ".join(parts) or "none"


def _departure(d: Departure) -> str:
    where = f"{d.phase} op #{d.index}" if d.index is not None else f"the end of {d.phase}"
    line = f" ({d.line})" if d.line else ""
    ours, theirs = ", ".join(d.target) or "nothing", ", ".join(d.reference) or "nothing"
    return f"at {where}{line} the target runs {ours} where the reference runs {theirs}"


def _row_dict(row: OpRow, factor: float) -> dict[str, Any]:
    return {**asdict(row), "ratio": row.ratio, "flagged": flagged(row, factor)}


def _finite(value: Any) -> Any:
    """JSON has no NaN/Inf: such numbers become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
