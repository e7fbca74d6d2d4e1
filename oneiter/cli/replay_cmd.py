"""`oneiter replay FILE --layer PATH`: run one recorded layer alone and check it against the recording; with `--ops`,
judge every aten op it runs by the op's own error (which kernel inside the culprit), with `--repro DIR` write a
reproducer of the culprit op.

Thin layer over `oneiter.judge.replayed.layer_verdict.replay_layer` and `oneiter.judge.replayed.op_verdict.replay_ops`
(the runs themselves:
`oneiter.record.replay.layer_replay`, `oneiter.record.replay.op_rerun`; the op report: `oneiter.report.op_table`);
torch is imported inside
the command so `oneiter --help` stays fast. Exit codes: 0 every tensor within tolerance (`--ops`: no op and not the
program flagged), 1 a tensor beyond it (an op or the program flagged), 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from oneiter.cli import option_aliases as opt
from oneiter.cli.common import EXIT_DIVERGED, EXIT_MATCH, err, fail, handle_errors, out, terminal_text
from oneiter.runtime import commands as flags

__all__ = ["replay", "print_report", "register"]

HELP = "\n\n".join([
    "Run one recorded layer from its recorded inputs and weights, compare its output and gradients with the "
    "recording, and time it (the layer-level analogue of ditorch's run_op_from_data).",
    "The model is rebuilt from the file's metadata with the recorded weights; the layer runs forward, then "
    "backward from the recorded output gradient. Checked: every output, the gradient of every input that "
    "required one, and the layer's parameter gradients when the layer was called once. On the recording's "
    "device the result should be bitwise equal; elsewhere it is judged with the dtype's default tolerance "
    "(float32: rtol 1.3e-6, atol 1e-5).",
    "With --ops the layer runs once on this machine's stack (its device, plugins and patched functions) under a "
    "dispatch mode, forward and backward, and every aten op it dispatches is rerun alone on exactly its own inputs "
    "in float64 on the CPU: its own error against its expected noise (what its precision does to a correct "
    "kernel). The first op above 4x its noise is named with its phase, inputs, strides and the line that called "
    "it. When no op is, but the layer's own code computed exactly does not give the reference's tensors, the "
    "program differs (an extra scale, another formula); --reference-ops (this command's --json from the "
    "reference's machine) shows where the op sequences part. --repro DIR writes the culprit op as DIR/repro.py "
    "and DIR/case.h5, runnable without oneiter.",
    "With --compile [BACKEND] (or a layer the model compiles itself) the layer runs its compiled code; --ops then "
    "judges the nodes of the graphs torch.compile hands the backend: each node's value as the compiled code "
    "computed it, against its own op rerun in float64 on those inputs (the kernels inside compiled code and its "
    "backward graph are not observable op by op).",
    "Exit code: 0 every tensor within tolerance (--ops: no op and not the program flagged), 1 a tensor beyond it "
    "(an op or the program flagged), 2 bad input.",
    "[bold]Examples[/]",
    "  oneiter replay ref.h5 --layer layer1.0.conv1",
    "  oneiter replay ref.h5 --layer layer1.0.relu --call 1",
    "  oneiter replay ref.h5 -l layer1.0.conv1 --device cuda --repeat 20 --json conv1.json",
    "  oneiter replay ref.h5 -l model.layers.0 -m my_llm.py:build --ops --device npu --amp bf16 --repro case/",
    "  oneiter replay ref.h5 -l model.layers.0 -m my_llm.py:build --ops --json ref_ops.json   [dim](reference)[/dim]",
    "  oneiter replay ref.h5 -l model.layers.0 -m my_llm.py:build --ops --compile inductor",
])

File = opt.RecordingFile
Layer = Annotated[
    str,
    typer.Option(*flags.LAYER.decls, show_default=False,
                 help="Module path as in named_modules(), e.g. layer1.0.conv1; '(root)' for the whole model."),
]
Call = Annotated[
    int, typer.Option(*flags.CALL.decls, min=0, help=
                      "Which call of the module (a module called twice has calls 0 and 1).")
]
Repeat = Annotated[
    int, typer.Option(*flags.REPEAT.decls, min=1, help="Timed runs, after one untimed run whose values are checked.")
]
JsonOut = Annotated[
    Optional[Path], typer.Option(*flags.JSON.decls, metavar="FILE", help="Write the result as JSON ('-': stdout).")
]
Ops = Annotated[bool, typer.Option(*flags.OPS.decls, help=
        "Judge every aten op the layer runs by its own error (see above).")]
Amp = Annotated[Optional[str], typer.Option(*flags.AMP.decls, help=
        "Autocast to run under: bf16, fp16 or none (default: the recording's own).")]
Dtype = Annotated[Optional[str], typer.Option(*flags.DTYPE.decls, help=
        "Cast the layer and its inputs: float32, bfloat16, float16, float64 (default: the recording's).")]
ReferenceOps = Annotated[Optional[Path], typer.Option(*flags.REFERENCE_OPS.decls, metavar="FILE", help=
        "With --ops: the --json of the same command run on the reference's stack, to show where the op sequences "
        "part.")]
Repro = Annotated[Optional[Path], typer.Option(*flags.REPRO.decls, metavar="DIR", help=
        "With --ops: write the first flagged op as DIR/repro.py and DIR/case.h5 (runs without oneiter).")]


def _checks_table(result):
    from oneiter.formatting import sci
    from oneiter.report.terminal import cell, plain_table

    table = plain_table()
    table.add_column("tensor", overflow="fold", min_width=8)
    for name in ("shape", "dtype", "bitwise"):
        table.add_column(name, no_wrap=True)
    for name in ("max abs", "rel L2"):
        table.add_column(name, justify="right", no_wrap=True)
    for c in result.checks:
        shape = "x".join(str(s) for s in c.shape) or "scalar"
        cells = (c.name, shape, c.dtype, "yes" if c.bitwise else "no", sci(c.max_abs, 9), sci(c.rel_l2, 9))
        table.add_row(*(cell(x) for x in cells), style="" if c.matched else "bold red")  # file text: never markup
    return table


def _verdict(result) -> str:
    """The verdict line, in rich markup: the names in it come from the file, so they are escaped."""
    from rich.markup import escape

    from oneiter.report.terminal import safe_text

    where = escape(safe_text(f"{result.key} ({result.class_name}) on {result.device}"))
    num = len(result.checks)
    if not num:
        return f"nothing to check: {where} has no recorded output or gradient tensor"
    if not result.matched:
        names = escape(safe_text(", ".join(c.name for c in result.checks if not c.matched)))
        return f"[bold red]DIVERGED[/]: {where}: beyond tolerance: {names}"
    if result.bitwise:
        return f"[bold green]match[/]: {where} reproduces its {num} recorded tensors bitwise"
    num_bitwise = sum(c.bitwise for c in result.checks)
    return f"[bold green]match[/]: {where}: {num} tensors within tolerance ({num_bitwise} bitwise)"


def _timing_line(result) -> str:
    runs = len(result.forward_seconds)
    parts = [f"{phase} median {t['median']:.3e} s, min {t['min']:.3e} s" for phase, t in result.timing().items()]
    return f"time per run ({runs} run{'s' if runs != 1 else ''}, {result.device}): " + "; ".join(parts)


def print_report(console, result) -> None:
    """Verdict first, then one row per checked tensor, then notes and the timing line."""
    console.print(_verdict(result), markup=True)
    if result.checks:
        console.print(_checks_table(result))
    from oneiter.report.terminal import safe_text

    for note in result.notes:
        console.print(f"note: {safe_text(note)}", markup=False)
    console.print(_timing_line(result), markup=False)


@handle_errors
def replay(
    file: File,
    layer: Layer,
    call: Call = 0,
    device: opt.Device = "cpu",
    repeat: Repeat = 1,
    json_path: JsonOut = None,
    model: opt.Model = None,
    ops: Ops = False,
    amp: Amp = None,
    dtype: Dtype = None,
    reference_ops: ReferenceOps = None,
    repro: Repro = None,
    compile: opt.Compile = None,
    float8: opt.Float8 = None,
) -> None:
    from oneiter.outputs import resolve

    # resolved before the run (`oneiter.outputs`): a refused path is one line; never the recording itself
    dest = None if json_path is None else resolve(json_path, flags.JSON.name, stdout_ok=True, inputs=(file,))
    run_amp = _amp(amp)
    if ops:
        raise typer.Exit(_replay_ops(file, layer, call, device, repeat, model, run_amp, dtype, reference_ops, repro,
                                     dest, compile, float8))
    if reference_ops is not None or repro is not None:
        raise fail(f"{flags.REFERENCE_OPS.name} and {flags.REPRO.name} go with {flags.OPS.name}")
    from oneiter.judge.replayed.layer_verdict import replay_layer

    result = replay_layer(file, layer, call=call, device=device, repeat=repeat, model=model, dtype=dtype, amp=run_amp,
                          compile=compile, float8=float8)
    _emit(dest, result.as_dict(), lambda console: print_report(console, result))
    raise typer.Exit(EXIT_MATCH if result.matched else EXIT_DIVERGED)


def _amp(amp: Optional[str]):
    """--amp as `replay_layer` takes it: the recording's own when not given, None for `none`."""
    from oneiter.record.replay.layer_replay import RECORDED

    if amp is None:
        return RECORDED
    return None if amp.lower() == "none" else amp


def _replay_ops(file, layer, call, device, repeat, model, amp, dtype, reference_ops, repro, dest, compile,
                float8=None) -> int:
    """`--ops`: the op report; returns the exit code."""
    if repeat != 1:
        raise fail(f"{flags.REPEAT.name} times a plain replay; with {flags.OPS.name} the layer runs once")
    from oneiter.judge.replayed.op_verdict import replay_ops
    from oneiter.report.op_table import print_ops

    result = replay_ops(file, layer, call=call, device=device, dtype=dtype, amp=amp, model=model,
                        reference_ops=reference_ops, repro=repro, compile=compile, float8=float8)
    doc = result.as_dict()
    _emit(dest, doc, lambda console: print_ops(console, doc))
    return result.exit_code


def _emit(dest, document: dict, show) -> None:
    """The human report (on stderr when the JSON goes to stdout), then the JSON where it was asked for."""
    from oneiter.outputs import write_text

    to_stdout = dest is not None and dest.to_stdout
    show(err if to_stdout else out)
    if dest is not None:
        write_text(dest, json.dumps(document, indent=1, allow_nan=False) + "\n")
        if not to_stdout:
            err.print(f"wrote {terminal_text(dest.given)}", markup=False)


def register(app: typer.Typer) -> None:
    """Add `replay` to the `oneiter` app."""
    app.command("replay", help=HELP, no_args_is_help=True, cls=opt.CompileCommand)(replay)
