"""`oneiter record`: thin CLI over `oneiter.record.run.record`."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from oneiter.cli import options as opt
from oneiter.cli.common import err, handle_errors
from oneiter.runtime import commands as flags

HELP = r"""Record one training iteration (forward, loss, backward, optimizer step) of every module call, several
consecutive iterations (--steps N: statistics per step, to find the first one that goes wrong), or iteration S of
a run in full (--step S).

[b]Examples[/b]

  oneiter record --model resnet18 --device cpu -o ref.h5

  oneiter record --model resnet18 --device npu --replay ref.h5 -o npu.h5

  oneiter record --model my_model.py:build --batch-size 4 -o ref.h5

  oneiter record --model resnet18 --amp bf16 --against cpu -o bf16.h5

  oneiter record --replay ref.h5 --amp bf16 --fallback convolution -o fb.h5

  torchrun --nproc-per-node 2 -m oneiter record --model resnet18 -o ref.h5
  [dim](writes ref.rank0.h5, ref.rank1.h5)[/dim]

  torchrun --nproc-per-node 2 -m oneiter record --replay ref.h5 --inject-fault layer2.0.conv1,rank=1 -o tgt.h5

  torchrun --nproc-per-node 4 -m oneiter record --model my_tp_model.py:build --data-parallel none -o tp.h5
  [dim](a model that splits itself across ranks: no DDP around it; its collectives are recorded)[/dim]

  oneiter record --model my_model.py:build --steps 100 -o ref_steps.h5

  oneiter record --replay ref_steps.h5 --model my_model.py:build --amp bf16 -o bf16_steps.h5

  oneiter record --model my_model.py:build --step 37 -o ref_step37.h5

  oneiter record --replay ref.h5 --model my_model.py:build --compile -o compiled.h5
  [dim](the model compiled with inductor: each compiled block judged against the eager reference)[/dim]

  oneiter record --replay ref.h5 -m my_llm.py:build --compile inductor --compile-modules 'layers\.\d+$' -o c.h5
"""


def record_command(
    out: Annotated[Path, typer.Option(*flags.OUT.decls, help="Output .h5 file (never overwritten without --force).")],
    model: opt.Model = None,
    device: opt.Device = "cpu",
    replay: Annotated[Optional[Path], typer.Option(*flags.REPLAY.decls, help=
            "Reference recording: start from its weights, buffers and batch.")] = None,
    seed: opt.Seed = 0,
    batch_size: Annotated[Optional[int], typer.Option(*flags.BATCH_SIZE.decls, min=1, help=
            "Batch size passed to the model builder (default 8; with --replay the reference's).")] = None,
    optimizer: Annotated[Optional[str], typer.Option(*flags.OPTIMIZER.decls, help=
            "sgd or adamw (single-tensor kernels); default sgd, with --replay the reference's.")] = None,
    dtype: opt.Dtype = "float32",
    amp: opt.Amp = None,
    include: Annotated[Optional[List[str]], typer.Option("--include", help=
            "Regex on module paths to record (repeatable).")] = None,
    exclude: Annotated[Optional[List[str]], typer.Option("--exclude", help=
            "Regex on module paths to skip (repeatable).")] = None,
    inject_fault: Annotated[Optional[List[str]], typer.Option(*flags.INJECT_FAULT.decls, help=
            "PATH[:forward|backward|inf][=REL][,rank=R]: perturb a layer on purpose (demos, tests); ,rank=R: on that "
            "torchrun rank only.")] = None,
    isolate: Annotated[bool, typer.Option("--isolate/--no-isolate", help=
            "With --replay: rerun every module call on the reference's inputs and output gradients (local "
            "error).")] = True,
    calibrate: Annotated[str, typer.Option("--calibrate", help=
            "Where each call's expected noise is measured: 'cpu' (float64 vs the run's precision, trusted kernels) or "
            "'device' (cheaper: a higher precision on the target device).")] = "cpu",
    against: Annotated[Optional[str], typer.Option("--against", help=
            "'cpu': no reference file; recompute every module call on the CPU in float32 from this run's own "
            "inputs.")] = None,
    random_replay: Annotated[bool, typer.Option("--random-replay/--no-random-replay", help=
            "With --replay: random ops (dropout masks) take the reference's values.")] = True,
    fallback: Annotated[Optional[str], typer.Option(*flags.FALLBACK.decls, help=
            "REGEX[,REGEX]: ops whose names fully match run on the CPU in float32 (e.g. convolution).")] = None,
    level: Annotated[str, typer.Option("--level", help=
            "full: every tensor's data; stats: per tensor float64 statistics and a checksum (min, max, mean, L2, "
            "sum|x|, NaN/Inf), no data — the screening step for large models (batch and weights stay full in a "
            "reference, so it can be replayed).")] = "full",
    steps: Annotated[Optional[int], typer.Option(*flags.STEPS.decls, help=
            "Record N consecutive iterations (0..N-1) into one file: per step the statistics of every tensor, its "
            "batch and random values, the loss, gradient and update norms (the first step's weights and optimizer "
            "state in full). With --replay of such a file: at most its number of steps (default: all), each also "
            "run by the perturbed twin that measures the band.")] = None,
    step: Annotated[Optional[int], typer.Option(*flags.STEP.decls, help=
            "Record iteration S alone, in full (iterations 0..S-1 run first, unrecorded); its optimizer state is "
            "in the file, so a --replay of it starts from the reference's state at S.")] = None,
    data_parallel: Annotated[str, typer.Option("--data-parallel", help=
            "Under torchrun: 'ddp' runs the model through DistributedDataParallel, 'none' as built, 'auto' through "
            "DDP unless it parallelises itself (DTensor parameters: FSDP2, tensor parallelism; Megatron-style "
            "layers), and then over the dimensions of its device mesh its parameters leave free (tensor "
            "parallelism on 'tp' of a (dp, tp) mesh: DDP over 'dp'); DIM=ddp|none,... decides per mesh dimension "
            "(dp=ddp,tp=none).")] = "auto",
    compile: opt.Compile = None,
    compile_modules: Annotated[Optional[List[str]], typer.Option(*flags.COMPILE_MODULES.decls, help=
            "With --compile: regex on module paths; each outermost matching module is compiled on its own, so "
            "module boundaries stay visible (repeatable).")] = None,
    model_arg: opt.ModelArg = None,
    threads: opt.Threads = None,
    force: opt.Force = False,
    quiet: opt.Quiet = False,
) -> None:
    from oneiter.cli.progress import live_status
    from oneiter.record.run import SpecOptions, record
    from oneiter.runtime.distributed import rank_info
    from oneiter.runtime.modelspec import parse_model_args

    options = SpecOptions(
        out=out, model=model, device=device, replay=replay, seed=seed, batch_size=batch_size, optimizer=optimizer,
        dtype=dtype, amp=amp, include=include or [], exclude=exclude or [], faults=inject_fault or [],
        model_args=parse_model_args(model_arg), threads=threads, force=force, isolate=isolate, calibrate=calibrate,
        against=against,
        random_replay=random_replay, fallback=_split(fallback), level=level, steps=steps, step=step,
        data_parallel=data_parallel, compile=compile, compile_modules=compile_modules or [],
    )
    info = rank_info()
    # under torchrun only rank 0 shows live progress; every rank prints its own summary line, prefixed
    prefix = f"[rank {info.rank}] " if info.distributed else ""
    status = live_status(f"recording {model or replay}", quiet=quiet) if info.rank == 0 else \
        nullcontext(lambda *_: None)
    notes = info.rank == 0 and not quiet
    with status as update:
        summary = record(options, progress=update,
                         notify=(lambda text: err.print(f"{prefix}{text}", markup=False)) if notes else None)
    what = f"{summary.num_calls} module calls, {summary.num_entries} tensors"
    if summary.num_steps:
        what = f"{summary.num_steps} steps ({what} each)"
    compiling = f", plus {summary.compile_seconds:.2f} s compiling" if summary.compile_seconds else ""
    err.print(
        f"{prefix}recorded {what}, {summary.file_bytes / 1e6:.1f} MB in {summary.seconds:.2f} s{compiling} (loss "
        f"{summary.loss:.6g}) -> {summary.path}",
        markup=False,
    )


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def register(app: typer.Typer) -> None:
    app.command("record", help=HELP, no_args_is_help=True, cls=opt.CompileCommand)(handle_errors(record_command))
