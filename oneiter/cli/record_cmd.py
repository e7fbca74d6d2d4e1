"""`oneiter record`: thin CLI over `oneiter.record.run.record`."""

from __future__ import annotations

from contextlib import nullcontext

import typer

from oneiter.cli import option_aliases as opt
from oneiter.cli import record_params as rec
from oneiter.cli.common import err, handle_errors

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

  oneiter record --replay ref.h5 --impact --impact-top 5 -o npu.h5
  [dim](which flagged call matters: the iteration again with each fixed; compare ranks them)[/dim]

  oneiter record --replay ref.h5 --model my_model.py:build --compile -o compiled.h5
  [dim](the model compiled with inductor: each compiled block judged against the eager reference)[/dim]

  oneiter record --replay ref.h5 -m my_llm.py:build --compile inductor --compile-modules 'layers\.\d+$' -o c.h5

  oneiter record --replay ref.h5 -m my_llm.py:build --float8 tensorwise -o fp8.h5
  [dim](the Linears in torchao's float8: each judged against the recipe's exact emulation; the report states what
  FP8 costs per call)[/dim]
"""


def record_command(
    out: rec.Out,
    model: opt.Model = None,
    device: opt.Device = "cpu",
    replay: rec.Replay = None,
    seed: opt.Seed = 0,
    batch_size: rec.BatchSize = None,
    optimizer: rec.Optimizer = None,
    dtype: opt.Dtype = "float32",
    amp: opt.Amp = None,
    float8: opt.Float8 = None,
    include: rec.Include = None,
    exclude: rec.Exclude = None,
    inject_fault: rec.InjectFault = None,
    isolate: rec.Isolate = True,
    calibrate: rec.Calibrate = "cpu",
    against: rec.Against = None,
    random_replay: rec.RandomReplay = True,
    fallback: rec.Fallback = None,
    level: rec.Level = "full",
    steps: rec.Steps = None,
    step: rec.Step = None,
    data_parallel: rec.DataParallel = "auto",
    compile: opt.Compile = None,
    compile_modules: rec.CompileModules = None,
    impact: rec.Impact = False,
    impact_top: rec.ImpactTop = None,
    impact_from: rec.ImpactFrom = None,
    model_arg: opt.ModelArg = None,
    threads: opt.Threads = None,
    force: opt.Force = False,
    quiet: opt.Quiet = False,
) -> None:
    """The `record` command (see HELP): each parameter is the `SpecOptions` field of its name (`record_params.py`)."""
    given = dict(locals())  # the parameters by name, taken before anything else is defined
    from oneiter.record.run import SpecOptions

    _record(SpecOptions(**rec.spec_fields(given)), str(model or replay), quiet)


def _record(options, label: str, quiet: bool) -> None:
    """Record (`record.run.record`) with live progress on rank 0, then the one line that says what was written."""
    from oneiter.cli.progress import live_status
    from oneiter.record.run import record
    from oneiter.runtime.distributed import rank_info

    info = rank_info()
    # under torchrun only rank 0 shows live progress; every rank prints its own summary line, prefixed
    prefix = f"[rank {info.rank}] " if info.distributed else ""
    status = live_status(f"recording {label}", quiet=quiet) if info.rank == 0 else nullcontext(lambda *_: None)
    notes = info.rank == 0 and not quiet
    with status as update:
        summary = record(options, progress=update,
                         notify=(lambda text: err.print(f"{prefix}{text}", markup=False)) if notes else None)
    what = f"{summary.num_calls} module calls, {summary.num_entries} tensors"
    if summary.num_steps:
        what = f"{summary.num_steps} steps ({what} each)"
    compiling = f", plus {summary.compile_seconds:.2f} s compiling" if summary.compile_seconds else ""
    if summary.impact_runs:
        compiling += f" ({summary.impact_runs} impact runs: {summary.impact_seconds:.2f} s)"
    err.print(
        f"{prefix}recorded {what}, {summary.file_bytes / 1e6:.1f} MB in {summary.seconds:.2f} s{compiling} (loss "
        f"{summary.loss:.6g}) -> {summary.path}",
        markup=False,
    )


def register(app: typer.Typer) -> None:
    app.command("record", help=HELP, no_args_is_help=True, cls=opt.CompileCommand)(handle_errors(record_command))
