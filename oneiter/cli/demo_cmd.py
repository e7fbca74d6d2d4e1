"""`oneiter demo`: reference and deliberately broken target on the CPU, then the report that names the layer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from oneiter.cli import option_aliases as opt
from oneiter.cli.common import err, handle_errors, out
from oneiter.runtime import commands as flags

HELP = """Run the whole loop on the CPU: record a reference, record a bf16 target with one layer broken on purpose
(5% forward fault), compare, and check that the report names that layer. Exit 0 when it does.

[b]Examples[/b]

  oneiter demo

  oneiter demo --model llama_tiny --dir /tmp/demo
"""


def demo_command(
    directory: Annotated[Path, typer.Option(*flags.DEMO_DIR.decls, help=
            "Where the two recordings go (created; overwritten).")] = Path("oneiter-demo"),
    model: opt.Model = "resnet18",
    batch_size: opt.BatchSize = 8,
    fault: Annotated[Optional[str], typer.Option(*flags.FAULT.decls, help=
            "Module path to break (default: a deep layer).")] = None,
) -> None:
    from oneiter.demo import run_demo
    from oneiter.report.terminal import print_report

    demo = run_demo(directory, model=model if model is not None else "resnet18", batch_size=batch_size, fault=fault,
                    say=err.print)
    print_report(out, demo.result)
    if demo.found:
        out.print(f"\n[bold green]demo OK:[/] oneiter named {demo.fault}, the layer that was broken on purpose.")
        return
    out.print(f"\n[bold red]demo FAILED:[/] the fault was in {demo.fault}, oneiter named {demo.named_layer}.")
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo", help=HELP)(handle_errors(demo_command))
