"""The `record` command's own options, one `Annotated` alias each (named as its parameter), and how its parameters
become a `SpecOptions` (`record/run.py`; a `RecordOptions` plus how to build the model): by name.

A parameter of `record_command` is the field of the same name, except those in `RENAMED` (the flag is singular and
repeatable: `--inject-fault` fills `faults`), with the conversion of `CONVERT` where the CLI's value is text or None
and the field's a list or dict. `CLI_ONLY` names the parameters that change how the command prints, not what it
records; `API_ONLY` the settings a CLI run has no option for, each with its reason. tests/cli/test_record_options.py
holds the two lists to the fields both ways (a field with no option, an option with no field, fails it), and each
option's default to its field's, so a new recording setting is a field in `record/options.py`, its alias here and
its parameter in `record_cmd.py`.

The options `record` shares with other commands are in `option_aliases.py` (`opt.Model`, ...). Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, List, Optional

import typer

from oneiter.runtime import commands as flags
from oneiter.runtime.modelspec import parse_model_args

__all__ = ["RENAMED", "CONVERT", "CLI_ONLY", "API_ONLY", "spec_fields"]

Out = Annotated[Path, typer.Option(*flags.OUT.decls, help="Output .h5 file (never overwritten without --force).")]
Replay = Annotated[Optional[Path], typer.Option(*flags.REPLAY.decls, help=
        "Reference recording: start from its weights, buffers and batch.")]
BatchSize = Annotated[Optional[int], typer.Option(*flags.BATCH_SIZE.decls, min=1, help=
        "Batch size passed to the model builder (default 8; with --replay the reference's).")]
Optimizer = Annotated[Optional[str], typer.Option(*flags.OPTIMIZER.decls, help=
        "sgd or adamw (single-tensor kernels); default sgd, with --replay the reference's.")]
Include = Annotated[Optional[List[str]], typer.Option(*flags.INCLUDE.decls, help=
        "Regex on module paths to record (repeatable).")]
Exclude = Annotated[Optional[List[str]], typer.Option(*flags.EXCLUDE.decls, help=
        "Regex on module paths to skip (repeatable).")]
InjectFault = Annotated[Optional[List[str]], typer.Option(*flags.INJECT_FAULT.decls, help=
        "PATH[:forward|backward|inf][=REL][,rank=R]: perturb a layer on purpose (demos, tests); ,rank=R: on that "
        "torchrun rank only.")]
Isolate = Annotated[bool, typer.Option(*flags.ISOLATE.decls, help=
        "With --replay: rerun every module call on the reference's inputs and output gradients (local "
        "error).")]
Calibrate = Annotated[str, typer.Option(*flags.CALIBRATE.decls, help=
        "Where each call's expected noise is measured: 'cpu' (float64 vs the run's precision, trusted kernels) or "
        "'device' (cheaper: a higher precision on the target device).")]
Against = Annotated[Optional[str], typer.Option(*flags.AGAINST.decls, help=
        "'cpu': no reference file; recompute every module call on the CPU in float32 from this run's own "
        "inputs.")]
RandomReplay = Annotated[bool, typer.Option(*flags.RANDOM_REPLAY.decls, help=
        "With --replay: random ops (dropout masks) take the reference's values.")]
Fallback = Annotated[Optional[str], typer.Option(*flags.FALLBACK.decls, help=
        "REGEX[,REGEX]: ops whose names fully match run on the CPU in float32 (e.g. convolution).")]
Level = Annotated[str, typer.Option(*flags.LEVEL.decls, help=
        "full: every tensor's data; stats: per tensor float64 statistics and a checksum (min, max, mean, L2, "
        "sum|x|, NaN/Inf), no data — the screening step for large models (batch and weights stay full in a "
        "reference, so it can be replayed).")]
Steps = Annotated[Optional[int], typer.Option(*flags.STEPS.decls, help=
        "Record N consecutive iterations (0..N-1) into one file: per step the statistics of every tensor, its "
        "batch and random values, the loss, gradient and update norms (the first step's weights and optimizer "
        "state in full). With --replay of such a file: at most its number of steps (default: all), each also "
        "run by the perturbed twin that measures the band.")]
Step = Annotated[Optional[int], typer.Option(*flags.STEP.decls, help=
        "Record iteration S alone, in full (iterations 0..S-1 run first, unrecorded); its optimizer state is "
        "in the file, so a --replay of it starts from the reference's state at S.")]
DataParallel = Annotated[str, typer.Option(*flags.DATA_PARALLEL.decls, help=
        "Under torchrun: 'ddp' runs the model through DistributedDataParallel, 'none' as built, 'auto' through "
        "DDP unless it parallelises itself (DTensor parameters: FSDP2, tensor parallelism; Megatron-style "
        "layers), and then over the dimensions of its device mesh its parameters leave free (tensor "
        "parallelism on 'tp' of a (dp, tp) mesh: DDP over 'dp'); DIM=ddp|none,... decides per mesh dimension "
        "(dp=ddp,tp=none).")]
CompileModules = Annotated[Optional[List[str]], typer.Option(*flags.COMPILE_MODULES.decls, help=
        "With --compile: regex on module paths; each outermost matching module is compiled on its own, so "
        "module boundaries stay visible (repeatable).")]
Impact = Annotated[bool, typer.Option(*flags.IMPACT.decls, help=
        "With --replay: rank the flagged calls by how much of the gap fixing each closes (loss, gradients, "
        "updated weights): the iteration runs again from its start once per flagged call with that call's "
        "output and input gradients computed in float64 on the trusted path, and once with all fixed. One "
        "iteration per call; compare shows the ranking.")]
ImpactTop = Annotated[Optional[int], typer.Option(*flags.IMPACT_TOP.decls, min=1, help=
        "With --impact: fix at most N flagged calls, largest own error first (default: all).")]
ImpactFrom = Annotated[Optional[Path], typer.Option(*flags.IMPACT_FROM.decls, help=
        "With --impact and a multi-step --replay: a one-iteration replay recorded in full (the --step S replay "
        "the steps' comparison prints) whose flagged calls are each fixed at every step; ranked by the loss gap "
        "at the last step.")]


RENAMED = {"inject_fault": "faults", "model_arg": "model_args"}
"""A parameter -> its `SpecOptions` field, where the names differ."""


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _listed(values: list[str] | None) -> list[str]:
    return list(values or [])


CONVERT: dict[str, Callable[[Any], Any]] = {
    "include": _listed, "exclude": _listed, "inject_fault": _listed, "compile_modules": _listed,
    "fallback": _split,  # REGEX[,REGEX]
    "model_arg": parse_model_args,  # KEY=VALUE ... -> dict
}
"""A parameter -> the function that turns its CLI value into the field's value."""

CLI_ONLY = {"quiet": "how the command prints (progress, notes), not what is recorded"}

API_ONLY = {
    "name": "the file's `model` attribute: the CLI writes its model spec there (record/run.py's root attributes)",
    "meta": "more root attributes of the file: the CLI's are its model spec, batch and seed (record/run.py)",
    "manage_autocast": "the CLI's training step never enters autocast itself: the Recorder always does",
    "skip": "module paths a framework integration never records (mmengine's data preprocessor)",
    "queue_bytes": "a memory bound for code that embeds the Recorder; the CLI's default suits its runs",
}
"""A `SpecOptions` field -> why `oneiter record` has no option for it (the API, `Recorder(...)`, has)."""


def spec_fields(params: dict[str, Any]) -> dict[str, Any]:
    """The `SpecOptions` keywords from the `record` command's parameters (name -> value), matched by name."""
    return {RENAMED.get(name, name): CONVERT.get(name, lambda value: value)(value) for name, value in params.items()
            if name not in CLI_ONLY}
