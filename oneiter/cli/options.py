"""Option aliases shared by commands that run a model (record, profile, replay): one definition, one help text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer
from typer.core import TyperCommand

Model = Annotated[
    str,
    typer.Option("--model", "-m", help="Built-in model name (see `oneiter models`) or path/to/file.py:function."),
]
Device = Annotated[str, typer.Option("--device", "-d", help=
        "Any torch device string: cpu, cuda:0, npu, mlu, dipu, xpu.")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Batch size passed to the model builder.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the torch RNG (weights, batch, dropout).")]
Dtype = Annotated[str, typer.Option("--dtype", help="Model dtype: float32, bfloat16, float16, float64.")]
Amp = Annotated[Optional[str], typer.Option("--amp", help="Automatic mixed precision: bf16 or fp16.")]
Threads = Annotated[Optional[int], typer.Option("--threads", min=1, help="torch intra-op threads (default: torch's).")]
ModelArg = Annotated[
    Optional[List[str]],
    typer.Option("--model-arg", help="KEY=VALUE passed to the model builder, e.g. image_size=64 (repeatable)."),
]
Force = Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help=
        "No progress on stderr (off a terminal progress is plain lines: one per phase, then one every few seconds).")]
RecordingFile = Annotated[
    Path, typer.Argument(metavar="FILE", help="A recording written by `oneiter record` (.h5).", show_default=False)
]
Compile = Annotated[Optional[str], typer.Option("--compile", metavar="[BACKEND]", help=
        "Compile with torch.compile: a backend name (alone: inductor; any registered name, a vendor's included). "
        "Observable of a compiled module: its inputs, outputs and their gradients, its parameters' gradients and "
        "updates; what runs inside its compiled code is not.")]


class CompileCommand(TyperCommand):
    """A command whose `--compile` alone means `--compile inductor` (typer has no option with an optional value)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        given = []
        for i, arg in enumerate(args):
            given.append(arg)
            if arg == "--compile" and (i + 1 == len(args) or args[i + 1].startswith("-")):
                given.append("inductor")
        return super().parse_args(ctx, given)
