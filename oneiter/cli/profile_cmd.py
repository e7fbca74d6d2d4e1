"""`oneiter profile` and `oneiter profile diff`: thin CLI over `oneiter.profile` (no torch import at module load)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from oneiter.cli import option_aliases as opt
from oneiter.cli.common import err, handle_errors, out
from oneiter.cli.help import HelpGroup
from oneiter.runtime import commands as flags
from oneiter.runtime.modelspec import parse_model_args

DEFAULT_MODEL = "resnet18"  # profiled without --model, so the product card's `oneiter profile --schedule ...` runs

HELP = """Profile training iterations with torch.profiler: a gzip Chrome trace per active cycle, op / memory /
per-module tables and summary.json in the output directory.

[b]Examples[/b]

  oneiter profile --model resnet18 --device cpu --schedule wait=1,warmup=1,active=2 -o prof/

  oneiter profile --model resnet18 --dtype bfloat16 --profile-memory --record-shapes -o prof_bf16/

  oneiter profile diff prof/ prof_bf16/

Open the .pt.trace.json.gz in https://ui.perfetto.dev or chrome://tracing, or run tensorboard --logdir prof/.
"""

DIFF_HELP = """Align two profile directories by module path and op name: time and memory on each side, B/A ratio,
and what exists on one side only. A is the reference (e.g. float32 or the reference device), B the target.

[b]Examples[/b]

  oneiter profile diff prof_fp32/ prof_bf16/

  oneiter profile diff prof_cpu/ prof_npu/ --sort ratio --limit 0 --json diff.json
"""

app = typer.Typer(
    name="profile",
    help=HELP,
    invoke_without_command=True,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    cls=HelpGroup,
)


def _opt(*names: str, help: str):
    return typer.Option(*names, help=help)


RENAMED = {"overhead": "measure_overhead", "model_arg": "model_args"}
"""A parameter of `profile_command` -> its `ProfileOptions` field, where the names differ (the others: the same)."""
CLI_ONLY = {"ctx": "typer's context (whether `profile diff` was asked for)",
            "limit": "rows per table printed: the files hold all of them", "quiet": "no progress and no notes"}
"""The parameters that change what the command prints, not what is profiled."""


def profile_fields(params: dict) -> dict:
    """The `ProfileOptions` keywords from `profile_command`'s parameters (name -> value), matched by name;
    tests/cli/test_profile_options.py holds the two to each other both ways."""
    return {RENAMED.get(name, name): parse_model_args(value) if name == "model_arg" else value
            for name, value in params.items() if name not in CLI_ONLY}


@app.callback()
@handle_errors
def profile_command(
    ctx: typer.Context,
    model: opt.Model = None,
    device: opt.Device = "cpu",
    batch_size: opt.BatchSize = 8,
    seed: opt.Seed = 0,
    dtype: opt.Dtype = "float32",
    amp: opt.Amp = None,
    threads: opt.Threads = None,
    model_arg: opt.ModelArg = None,
    optimizer: Annotated[str, _opt(*flags.OPTIMIZER.decls, help="sgd or adamw (single-tensor kernels).")] = "sgd",
    schedule: Annotated[str, _opt(*flags.SCHEDULE.decls, help=
            "wait,warmup,active,repeat,skip_first as KEY=VALUE; unset keys: wait=0, warmup=1, active=1, repeat=1, "
            "skip_first=0.")] = "wait=1,warmup=1,active=2",
    out_dir: Annotated[Path, _opt(*flags.OUT.decls, help=
            "Output directory (a previous profile there needs --force).")] = Path("prof"),
    record_shapes: Annotated[bool, _opt(*flags.RECORD_SHAPES.decls, help=
            "Record input shapes (op table grouped by shape).")] = False,
    profile_memory: Annotated[bool, _opt(*flags.PROFILE_MEMORY.decls, help=
            "Record allocations: memory table, module memory, CUDA snapshot.")] = False,
    with_stack: Annotated[bool, _opt(*flags.WITH_STACK.decls, help=
            "Python stack frames in the trace (several times larger).")] = False,
    with_flops: Annotated[bool, _opt(*flags.WITH_FLOPS.decls, help="Estimate FLOPs of matmul/conv ops.")] = False,
    memory_sort: Annotated[str, _opt(*flags.MEMORY_SORT.decls, help=
            "Memory table order: self_cpu_memory, cpu_memory, self_device_memory, device_memory.")] = "self_cpu_memory",
    module_ranges: Annotated[bool, _opt(*flags.MODULE_RANGES.decls, help=
            "Forward/backward ranges per module path (the module table).")] = True,
    overhead: Annotated[bool, _opt(*flags.OVERHEAD.decls, help=
            "Also time unprofiled steps (as many as recorded, at least 5) and report the ratio of median step times, "
            "or that the machine is too noisy to tell.")] = True,
    max_steps: Annotated[int, _opt(*flags.MAX_STEPS.decls, help=
            "Refuse schedules that need more training steps than this.")] = 100,
    limit: Annotated[int, _opt(*flags.LIMIT.decls, help="Rows per table printed (0: all; files hold all rows).")] = 15,
    force: opt.Force = False,
    quiet: opt.Quiet = False,
) -> None:
    given = dict(locals())  # the parameters by name, taken before anything else is defined (`profile_fields`)
    if ctx.invoked_subcommand is not None:
        return
    if model is None:
        given["model"] = model = DEFAULT_MODEL
        if not quiet:
            err.print(f"no --model: profiling the built-in {model} (--model NAME or path/to/file.py:function for "
                      f"another)", markup=False)
    from oneiter.profile.runner import ProfileOptions, profile

    options = ProfileOptions(**profile_fields(given))
    with _progress(f"profiling {model} on {device}", quiet) as on_step:
        result = profile(options, on_step=on_step)
    for note in [] if quiet else result.notes:
        err.print(f"note: {note}", markup=False)
    for warning in result.warnings:
        err.print(f"[yellow]warning:[/] {warning}", markup=True)
    out.print(_report(result, limit or None), markup=False)


@contextlib.contextmanager
def _progress(title: str, quiet: bool = False):
    """`on_step(step, num_steps, phase)` driving a transient progress bar on stderr; off a terminal plain lines
    (`cli/progress.py`); nothing when `quiet`. Refreshed only from the callback, between steps: the profiler's
    native output filter must not catch it."""
    from oneiter.cli.progress import PlainProgress, plain_line, shows_progress

    if not shows_progress(quiet):
        yield None
        return
    if not err.is_terminal:
        plain = PlainProgress(title, plain_line)
        yield lambda step, num_steps, phase: plain(phase, f"step {step + 1} of {num_steps}")
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=err,
                  transient=True, auto_refresh=False) as bar:  # fmt: skip
        task = bar.add_task(title, total=None)

        def on_step(step: int, num_steps: int, phase: str) -> None:
            bar.update(task, total=num_steps, completed=step + 1, description=f"{title}: step {step} {phase}")
            bar.refresh()

        yield on_step


def _report(result, limit: int | None) -> str:
    from oneiter.profile.tables import format_memory, format_modules, format_ops

    s, last = result.summary, result.cycles[-1]
    lines = [f"profiled {s['model']} on {s['device']} ({s['dtype']}{', amp ' + s['amp'] if s['amp'] else ''}, "
             f"batch {s['batch_size']}), schedule {s['schedule']}: {len(result.cycles)} trace(s) in "
                     f"{result.out_dir}"]  # fmt: skip
    for cycle in result.cycles:
        lines.append(f"  steps {cycle['steps']}: {cycle['trace']}  {cycle['trace_bytes'] / 2**10:.1f} KiB "
                     f"({cycle['trace_json_bytes'] / 2**20:.1f} MiB JSON, written in "
                             f"{cycle['export_seconds']:.2f} s)")  # fmt: skip
    if result.overhead:
        o = result.overhead
        lines.append(f"overhead: {o['verdict']}")
    device = s["device"] != "cpu"
    lines += ["", f"== ops (last cycle, steps {last['steps']}) ==", format_ops(last["ops"], limit, device=device)]
    if s["options"]["profile_memory"]:
        sort = s["options"]["memory_sort"]
        lines += [f"== memory (by {sort}) ==", format_memory(last["memory"], sort, limit, device=device)]
    if last["modules"]:
        lines += ["== leaf modules (slowest first) ==", format_modules(last["modules"], limit, slowest_leaves=True)]
    lines.append(f"all rows: {result.out_dir / last['tables']} and {result.summary_path}; "
                 "open the trace in https://ui.perfetto.dev, chrome://tracing, or tensorboard --logdir "
                         f"{result.out_dir}")  # fmt: skip
    return "\n".join(lines)


@app.command("diff", help=DIFF_HELP, no_args_is_help=True)
@handle_errors
def diff_command(
    dir_a: Annotated[Path, typer.Argument(help="Reference profile directory (A).", metavar="A")],
    dir_b: Annotated[Path, typer.Argument(help="Target profile directory (B).", metavar="B")],
    sort: Annotated[str, _opt(*flags.SORT.decls, help=
            "Row order: delta (largest |B-A| first), ratio, model.")] = "delta",
    limit: Annotated[int, _opt(*flags.LIMIT.decls, help="Rows per table printed (0: all).")] = 20,
    json_out: Annotated[Optional[Path], _opt(*flags.JSON.decls, help=
            "Also write the aligned rows as JSON to FILE ('-': stdout only).")] = None,
) -> None:
    from oneiter.errors import OneIterError
    from oneiter.profile.diff import DIFF_SORTS, diff_profiles, format_diff

    if sort not in DIFF_SORTS:
        raise OneIterError(f"{flags.SORT.name} must be one of {', '.join(DIFF_SORTS)}, got '{sort}'")
    from oneiter.outputs import resolve, write_text

    dest = None if json_out is None else resolve(json_out, flags.JSON.name, stdout_ok=True)
    diff = diff_profiles(dir_a, dir_b)
    if dest is not None:
        write_text(dest, json.dumps(diff.to_json(), indent=1) + "\n")
        if dest.to_stdout:
            return
    out.print(format_diff(diff, limit or None, sort), markup=False)
