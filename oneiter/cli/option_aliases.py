"""Option aliases shared by the commands: one definition, one help text each.

The flag names come from `oneiter.runtime.commands`, the one table of the CLI's flag names, which also builds the
command lines oneiter prints for a user to run (`record --step S`, `record --replay`, `replay --ops`), so a printed
command never names a flag the CLI does not have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from oneiter.cli.help import HelpCommand
from oneiter.runtime import commands as flags

Model = Annotated[Optional[str], typer.Option(*flags.MODEL.decls, help=
        "Built-in model name (see `oneiter models`) or path/to/file.py:function. Without it, `profile` and `demo` "
        "run resnet18; given a recording (`record --replay`, `replay`, `compare --drill`) the recorded built-in model "
        "is the default, and a model file must be named (a recording never picks the code that runs).")]
Device = Annotated[str, typer.Option(*flags.DEVICE.decls, help=
        "Any torch device string: cpu, cuda:0, npu, mlu, dipu, xpu.")]
BatchSize = Annotated[int, typer.Option(*flags.BATCH_SIZE.decls, min=1, help=
        "Batch size passed to the model builder.")]
Seed = Annotated[int, typer.Option(*flags.SEED.decls, help="Seed of the torch RNG (weights, batch, dropout).")]
Dtype = Annotated[str, typer.Option(*flags.DTYPE.decls, help="Model dtype: float32, bfloat16, float16, float64.")]
Amp = Annotated[Optional[str], typer.Option(*flags.AMP.decls, help="Automatic mixed precision: bf16 or fp16.")]
Float8 = Annotated[Optional[str], typer.Option(*flags.FLOAT8.decls, help=
        "tensorwise or rowwise: convert the model's Linears to torchao's float8 training (dimensions divisible by "
        "16; the output projection, lm_head/output, stays in high precision). Needs pip install -c "
        "constraints.txt 'oneiter\\[float8]'.")]  # \\[: rich markup would eat `[float8]`
Threads = Annotated[Optional[int], typer.Option(*flags.THREADS.decls, min=1, help=
        "torch intra-op threads (default: torch's).")]
ModelArg = Annotated[Optional[List[str]], typer.Option(*flags.MODEL_ARG.decls, help=
        "KEY=VALUE passed to the model builder, e.g. image_size=64 (repeatable).")]
Force = Annotated[bool, typer.Option(*flags.FORCE.decls, help="Overwrite an existing output.")]
Quiet = Annotated[bool, typer.Option(*flags.QUIET.decls, help=
        "No progress and no notes on stderr (off a terminal progress is plain lines: one per phase, then one every "
        "few seconds): one line says what was written; errors and warnings still print.")]
RecordingFile = Annotated[
    Path, typer.Argument(metavar="FILE", help="A recording written by `oneiter record` (.h5).", show_default=False)
]
Compile = Annotated[Optional[str], typer.Option(*flags.COMPILE.decls, metavar="[BACKEND]", help=
        "Compile with torch.compile: a backend name (alone: inductor; any registered name, a vendor's included). "
        "Observable of a compiled module: its inputs, outputs and their gradients, its parameters' gradients and "
        "updates; what runs inside its compiled code is not.")]


class CompileCommand(HelpCommand):
    """A command whose `--compile` alone means `--compile inductor` (typer has no option with an optional value)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        given = []
        for i, arg in enumerate(args):
            given.append(arg)
            if arg == flags.COMPILE.name and (i + 1 == len(args) or args[i + 1].startswith("-")):
                given.append("inductor")
        return super().parse_args(ctx, given)
