"""`oneiter replay FILE --layer PATH`: run one recorded layer alone and check it against the recording.

Thin layer over `oneiter.judge.layer.replay_layer` (the run itself: `oneiter.record.layer_replay`); torch is
imported inside the command so `oneiter --help` stays fast. Exit codes: 0 every tensor within tolerance, 1 a
tensor beyond it, 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from oneiter.cli import options as opt
from oneiter.cli.common import EXIT_DIVERGED, EXIT_MATCH, err, handle_errors, out, terminal_text

__all__ = ["replay", "print_report", "register"]

HELP = "\n\n".join([
    "Run one recorded layer from its recorded inputs and weights, compare its output and gradients with the "
    "recording, and time it (the layer-level analogue of ditorch's run_op_from_data).",
    "The model is rebuilt from the file's metadata with the recorded weights; the layer runs forward, then "
    "backward from the recorded output gradient. Checked: every output, the gradient of every input that "
    "required one, and the layer's parameter gradients when the layer was called once. On the recording's "
    "device the result should be bitwise equal; elsewhere it is judged with the dtype's default tolerance "
    "(float32: rtol 1.3e-6, atol 1e-5).",
    "Exit code: 0 every tensor within tolerance, 1 a tensor beyond it, 2 bad input.",
    "[bold]Examples[/]",
    "  oneiter replay ref.h5 --layer layer1.0.conv1",
    "  oneiter replay ref.h5 --layer layer1.0.relu --call 1",
    "  oneiter replay ref.h5 -l layer1.0.conv1 --device cuda --repeat 20 --json conv1.json",
])

File = opt.RecordingFile
Layer = Annotated[
    str,
    typer.Option("--layer", "-l", show_default=False,
                 help="Module path as in named_modules(), e.g. layer1.0.conv1; '(root)' for the whole model."),
]
Call = Annotated[
    int, typer.Option("--call", min=0, help="Which call of the module (a module called twice has calls 0 and 1).")
]
Repeat = Annotated[
    int, typer.Option("--repeat", "-r", min=1, help="Timed runs, after one untimed run whose values are checked.")
]
JsonOut = Annotated[
    Optional[Path], typer.Option("--json", metavar="FILE", help="Write the result as JSON ('-': stdout).")
]


def _sci(value: float) -> str:
    return f"{value:9.2e}"


def _table(result):
    from rich.table import Table

    from oneiter.report.terminal import cell

    table = Table(header_style="bold", box=None, pad_edge=False)
    table.add_column("tensor", overflow="fold", min_width=8)
    for name in ("shape", "dtype", "bitwise"):
        table.add_column(name, no_wrap=True)
    for name in ("max abs", "rel L2"):
        table.add_column(name, justify="right", no_wrap=True)
    for c in result.checks:
        shape = "x".join(str(s) for s in c.shape) or "scalar"
        cells = (c.name, shape, c.dtype, "yes" if c.bitwise else "no", _sci(c.max_abs), _sci(c.rel_l2))
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
        console.print(_table(result))
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
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=
            "The model file (path/to/file.py:function) the recording was made from: a recording never picks the code "
            "that runs. Built-in models default to the recorded name.")] = None,
) -> None:
    from oneiter.judge.layer import replay_layer
    from oneiter.outputs import resolve, write_text

    # resolved before the run (`oneiter.outputs`): a refused path is one line; never the recording itself
    dest = None if json_path is None else resolve(json_path, "--json", stdout_ok=True, inputs=(file,))
    result = replay_layer(file, layer, call=call, device=device, repeat=repeat, model=model)
    to_stdout = dest is not None and dest.to_stdout
    print_report(err if to_stdout else out, result)
    if dest is not None:
        write_text(dest, json.dumps(result.as_dict(), indent=1) + "\n")
        if not to_stdout:
            err.print(f"wrote {terminal_text(dest.given)}", markup=False)
    raise typer.Exit(EXIT_MATCH if result.matched else EXIT_DIVERGED)


def register(app: typer.Typer) -> None:
    """Add `replay` to the `oneiter` app."""
    app.command("replay", help=HELP, no_args_is_help=True)(replay)
