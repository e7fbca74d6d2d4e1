"""`oneiter inspect FILE`: what a recording holds — metadata, then one line per tensor with simple statistics.

Thin layer over `oneiter.format.inspection` (which reads one tensor at a time); numpy and h5py are imported inside
the command so `oneiter --help` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from oneiter.cli import option_aliases
from oneiter.cli.common import handle_errors, out
from oneiter.runtime import commands as flags

__all__ = ["inspect", "register"]

HELP = "\n\n".join([
    "List what a recording holds: metadata, then every tensor with shape, dtype and statistics.",
    "Tensors: the batch, the loss, forward and backward of each module call, parameter gradients, updated "
    "parameters and the state before the step. min, max, mean and std are over finite elements, in float64; "
    "NaN/Inf are counted apart.",
    "[bold]Examples[/]",
    "  oneiter inspect cpu.h5",
    "  oneiter inspect cpu.h5 --json > cpu.json",
])

File = option_aliases.RecordingFile
AsJson = Annotated[bool, typer.Option(*flags.JSON.decls, help="Print JSON to stdout instead of the table.")]


def _header(summary) -> list[str]:
    meta = {k: v for k, v in summary.meta.items() if k not in ("schema", "complete") and v not in (None, "")}
    pad = max([9, *(len(k) + 1 for k in meta)])
    lines = [f"{'file':<{pad}} {summary.path}"]
    lines += [f"{k:<{pad}} {v}" for k, v in meta.items()]
    lines.append(f"{'contents':<{pad}} {summary.num_calls} module calls, {len(summary.tensors)} tensors")
    return lines


def _tensors_table(summary):
    from oneiter.formatting import sci
    from oneiter.report.terminal import cell, plain_table

    table = plain_table()
    for name in ("#", "module@call", "phase", "tensor", "shape", "dtype"):
        table.add_column(name, no_wrap=name != "module@call", overflow="fold")
    for name in ("min", "max", "mean", "std"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("nan/inf", justify="right", no_wrap=True)
    for i, t in enumerate(summary.tensors):
        shape = "x".join(str(s) for s in t.shape) or "scalar"
        bad = f"{t.num_nan}/{t.num_inf}" if (t.num_nan or t.num_inf) else ""
        cells = (str(i), f"{t.module}@{t.call}", t.phase, t.tensor, shape, t.dtype,
                 *(sci(v, 10, digits=3) for v in (t.min, t.max, t.mean, t.std)), bad)
        table.add_row(*(cell(c) for c in cells), style="yellow" if bad else "")  # file text: never markup
    return table


def _as_json(summary) -> dict[str, Any]:
    return {"path": summary.path, "meta": summary.meta, "num_calls": summary.num_calls,
            "tensors": [t.as_dict() for t in summary.tensors]}


@handle_errors
def inspect(file: File, as_json: AsJson = False) -> None:
    """The `inspect` command; see HELP."""
    import json

    from rich.text import Text

    from oneiter.format.inspection import summarize_file
    from oneiter.report.terminal import print_wide, safe_text

    summary = summarize_file(file)
    if as_json:
        out.out(json.dumps(_as_json(summary), indent=1, default=str), highlight=False)
        return
    for line in _header(summary):
        out.print(Text(safe_text(line)))
    print_wide(out, _tensors_table(summary))


def register(app: typer.Typer) -> None:
    """Add `inspect` to the `oneiter` app."""
    app.command("inspect", help=HELP, no_args_is_help=True)(inspect)
