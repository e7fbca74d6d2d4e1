"""`oneiter compare REF TARGET`: the CLI face of `oneiter.judge` — options in, report out, exit code.

Thin on purpose: the work is in `oneiter.judge.iteration.engine` (and `report` for output; `ranks` for the files of a
multi-rank run). torch/numpy are imported inside the command so `oneiter --help` stays fast. Exit codes: 0 match,
1 divergence, 2 bad input or inconclusive (the result's `exit_code`), 3 an internal error. Every output path is
resolved by `oneiter.outputs` before the comparison runs: files are written whole or not at all, devices, FIFOs
and `/dev/stdout` directly, `-` is stdout for --json and --csv.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from oneiter.cli import option_aliases as opt
from oneiter.cli.common import err, handle_errors, out, set_outcome, terminal_text
from oneiter.errors import OneIterError
from oneiter.runtime import commands as flags

__all__ = ["compare", "register"]

HELP = "\n\n".join([
    "Compare two recordings of one training iteration and name the culprit: the innermost module call whose own "
    "computation differs by more than its expected noise.",
    "With local data (the target recorded with `record --replay`, or one file recorded with `--against cpu`), every "
    "module call was rerun on the reference's inputs, so its own error is measured apart from upstream drift. The "
    "culprit is the first call, in causal order, whose own error exceeds 4x its expected noise (what the run's "
    "precision does to a correct computation; --tolerances can change the factor), or that makes NaN/Inf the "
    "reference does not; the report also lists the chain of calls containing it. Accumulated error outside "
    "tolerance is drift, not a divergence. When no call is to blame but the loss, a parameter gradient, an updated "
    "parameter or a call that could not be probed differs more than the precision explains, the verdict is "
    "DIVERGED (unattributed).",
    "Without local data (`record --no-isolate`, or two plain recordings) the verdict is the first divergence: the "
    "first entry outside tolerance in causal order (forward as executed, backward as the gradients were computed, "
    "then parameter gradients, then updated parameters). Entries are paired by module path, call index and tensor "
    "name; one present on one side only, with another shape or dtype, or with NaN/Inf elsewhere is a divergence, "
    "never a pass.",
    "Default tolerances are torch.testing.assert_close's for each dtype (float32: rtol 1.3e-6, atol 1e-5); "
    "--rtol / --atol replace them. The terminal report, --json, --csv, --html and --tensorboard state one verdict. "
    "Exit code: 0 match, 1 divergence, 2 bad input or inconclusive (local data, but no call's own error could be "
    "measured), 3 an internal error (please report it).",
    "Two multi-step recordings (record --steps N, the target with --replay) are compared step by step: the loss, "
    "gradient and update norms of both runs, each step's error against the band a precision change explains "
    "(measured by the target's perturbed twin: docs/steps.md); the verdict names the first step outside the band "
    "(exit 1) and prints the two commands that record it in full (record --step S), where the layer is named.",
    "Multi-rank runs (torchrun ... record -o ref.h5 writes ref.rank0.h5, ref.rank1.h5, ...): give two directories, "
    "or the names given to -o; files are paired by rank and compared in parallel processes, with one verdict per "
    "rank and an overall one naming the rank. A rank missing on one side exits 2.",
    "--drill goes one level down, into the culprit call: when the target's device is on this machine (and its model "
    "can be built: built-in, or named with --model), the call is rerun from the reference's inputs op by op, each "
    "aten op judged by its own error (`oneiter replay --ops`); otherwise the report prints that command to run on "
    "the target's machine.",
    "[bold]Examples[/]",
    "  oneiter compare cpu.h5 cuda.h5",
    "  oneiter compare cpu.h5 npu.h5 --rtol 1e-4 --json report.json",
    "  oneiter compare cpu.h5 npu.h5 --all --csv rows.csv",
    "  oneiter compare ref.h5 tgt.h5   [dim](ref.rank*.h5 vs tgt.rank*.h5 when ref.h5 does not exist)[/dim]",
    "  oneiter compare ref_dir/ tgt_dir/ --json -",
    "  oneiter compare ref.h5 tgt.h5 --drill --model my_model.py:build --html report.html",
])

Reference = Annotated[
    Path,
    typer.Argument(metavar="REF", show_default=False,
                   help="The reference recording (.h5), e.g. made on CPU; or a multi-rank run (directory, -o name)."),
]
Target = Annotated[
    Optional[Path],
    typer.Argument(metavar="TARGET", show_default=False,
                   help="The recording to judge against it (.h5), or a multi-rank run."),
]
Rtol = Annotated[Optional[float], typer.Option(*flags.RTOL.decls, min=0.0, help="Relative tolerance for every entry.")]
Atol = Annotated[Optional[float], typer.Option(*flags.ATOL.decls, min=0.0, help="Absolute tolerance for every entry.")]
ShowAll = Annotated[bool, typer.Option(*flags.SHOW_ALL.decls, help=
        "Show every entry, not only those around the divergence.")]
JsonOut = Annotated[
    Optional[Path], typer.Option(*flags.JSON.decls, metavar="FILE", help=
                                 "Write the full report as JSON ('-': stdout).")
]
CsvOut = Annotated[Optional[Path], typer.Option(*flags.CSV.decls, metavar="FILE", help=
        "Write one CSV line per entry ('-': stdout).")]
Tolerances = Annotated[
    Optional[Path],
    typer.Option(*flags.TOLERANCES.decls, metavar="FILE", help=
            "Per-device tolerance file: .toml (data), or an mmengine .py config, which is Python code and is "
            "executed."),
]
HtmlOut = Annotated[Optional[Path], typer.Option(*flags.HTML.decls, metavar="FILE", help=
        "Write a self-contained HTML report.")]
TbOut = Annotated[
    Optional[Path], typer.Option(*flags.TENSORBOARD.decls, metavar="DIR", help=
                                 "Write TensorBoard error curves and histograms.")
]


def _destinations(json_path, csv_path, html_path, inputs: tuple[Path, ...]) -> dict:
    """Each report output resolved (`oneiter.outputs`) before anything runs: a refused one is one line, exit 2;
    two that would write the same file, or both to stdout, are refused too."""
    from oneiter.outputs import check_distinct, resolve

    given = [(flags.JSON.name, json_path, True), (flags.CSV.name, csv_path, True), (flags.HTML.name, html_path, False)]
    dests = {option: resolve(path, option, stdout_ok=ok, inputs=inputs) for option, path, ok in given
             if path is not None}
    check_distinct(list(dests.items()))
    return dests


@handle_errors
def compare(
    reference: Reference,
    target: Target = None,
    rtol: Rtol = None,
    atol: Atol = None,
    show_all: ShowAll = False,
    json_path: JsonOut = None,
    csv_path: CsvOut = None,
    tolerances: Tolerances = None,
    html_path: HtmlOut = None,
    tb_dir: TbOut = None,
    suggest: Annotated[bool, typer.Option(*flags.SUGGEST.decls, help=
            "Print the --include that records the first divergence's region in full (after a --level stats "
            "screening).")] = False,
    drill: Annotated[bool, typer.Option(*flags.DRILL.decls, help=
            "Judge the culprit call op by op on this machine when the target's stack is here (else print the "
            "command).")] = False,
    model: opt.Model = None,
) -> None:
    """The `compare` command; see HELP."""
    from oneiter.judge.stepwise.step_compare import StepsResult

    inputs = (reference,) if target is None else (reference, target)
    dests = _destinations(json_path, csv_path, html_path, inputs)
    if tb_dir is not None:
        from oneiter.outputs import resolve_folder

        resolve_folder(tb_dir, flags.TENSORBOARD.name)
    # a report written to stdout (`--json -`, `--csv /dev/stdout`) is all stdout carries: the human report goes to
    # stderr
    to_stdout = any(d.to_stdout for d in dests.values())
    if _ranked_inputs(reference, target, dests, tb_dir is not None, drill) and target is not None:  # ranked: a pair
        raise typer.Exit(_compare_ranks(reference, target, rtol, atol, tolerances, show_all, dests.get(flags.JSON.name),
                                        to_stdout))

    _check_steps_options(reference, target, {flags.TENSORBOARD.name: tb_dir is not None, flags.SUGGEST.name: suggest,
                                             flags.DRILL.name: drill})
    result = run_compare(reference, target, rtol=rtol, atol=atol, tolerances=tolerances)
    set_outcome(result.exit_code)  # the exit code if the reader of stdout goes away while we print
    if isinstance(result, StepsResult):  # two multi-step recordings: step by step
        raise typer.Exit(_report_steps(result, dests, show_all, to_stdout))

    _report_one(result, dests, tb_dir, model, show_all=show_all, suggest=suggest,
                to_stdout=to_stdout, drill=drill)
    raise typer.Exit(result.exit_code)


def _report_one(result, dests: dict, tb_dir: Optional[Path], model: Optional[str], *, show_all: bool, suggest: bool,
                to_stdout: bool, drill: bool) -> None:
    """The reports of one iteration's comparison: the terminal's (on stderr when a report goes to stdout), --drill,
    --json, --csv, --html, --tensorboard, --suggest."""
    from oneiter.report import terminal as report

    report.print_report(err if to_stdout else out, result, show_all=show_all)
    drilled = _drill(result, model, err if to_stdout else out) if drill else None

    def document() -> dict:
        return {**result.to_json(), **({"drill": drilled} if drilled is not None else {})}

    _emit_json(dests.get(flags.JSON.name), document)
    if flags.CSV.name in dests:
        report.write_csv(result, dests[flags.CSV.name])
        _wrote(dests[flags.CSV.name])
    if flags.HTML.name in dests:
        from oneiter.report.html import write_html

        write_html(document(), dests[flags.HTML.name])
        _wrote(dests[flags.HTML.name])
    if tb_dir is not None:
        from oneiter.report.tensorboard import write_tensorboard

        event_file = write_tensorboard(result, tb_dir, result.reference, result.target)
        err.print(f"wrote {event_file} (view: tensorboard --logdir {tb_dir})", markup=False)
    if suggest:
        _print_suggestion(result, err if to_stdout else out)


def _ranked_inputs(reference, target, dests: dict, tensorboard: bool, drill: bool) -> bool:
    """Whether the inputs are two multi-rank runs (compared rank by rank), with the options that take one pair
    refused; under torchrun they must be (its processes share their files)."""
    from oneiter.judge.iteration.ranks import is_ranked
    from oneiter.runtime.distributed import rank_info

    ranked = target is not None and (is_ranked(reference) or is_ranked(target))
    if rank_info().distributed and not ranked:
        raise OneIterError("compare under torchrun shares the files of multi-rank runs among its processes: give "
                           "two multi-rank runs (directories, or the -o names of their rank files)")
    unsupported = [o for o in (flags.CSV.name, flags.HTML.name) if o in dests] + (
        [flags.TENSORBOARD.name] if tensorboard else []) + ([flags.DRILL.name] if drill else [])
    if ranked and unsupported:
        raise OneIterError(f"{unsupported[0]} takes one pair of files: give one rank's files, e.g. a.rank1.h5")
    return ranked


def _check_steps_options(reference, target, given: dict[str, bool]) -> None:
    """Options of the one-iteration report are refused for two multi-step recordings, before anything is judged."""
    from oneiter.judge.stepwise.step_compare import is_steps

    one_iteration = next((name for name, on in given.items() if on), None)
    if one_iteration is not None and target is not None and (is_steps(reference) or is_steps(target)):
        raise OneIterError(f"{one_iteration} takes recordings of one iteration: of two multi-step recordings, record "
                           f"the step the verdict names in full")


def _report_steps(result, dests: dict, show_all: bool, to_stdout: bool) -> int:
    """The reports of two multi-step recordings compared (`report/multistep.py`); returns the exit code."""
    from oneiter.report.multistep import print_steps, write_steps_csv, write_steps_html

    print_steps(err if to_stdout else out, result, show_all=show_all)
    _emit_json(dests.get(flags.JSON.name), result.to_json)
    if flags.CSV.name in dests:
        write_steps_csv(result, dests[flags.CSV.name])
        _wrote(dests[flags.CSV.name])
    if flags.HTML.name in dests:
        write_steps_html(result, dests[flags.HTML.name])
        _wrote(dests[flags.HTML.name])
    return result.exit_code


def _drill(result, model: Optional[str], console) -> Optional[dict]:
    """`--drill`: the culprit call's op report (or the command to make it) printed; its JSON document, or None."""
    from oneiter.judge.replayed.op_verdict import drill
    from oneiter.report.op_table import print_drill

    found = drill(result, model=model)
    if found is None:
        console.print("drill: the verdict names no module call to drill into", markup=False)
        return None
    doc = found.as_dict()
    print_drill(console, doc)
    return doc


def _print_suggestion(result, console) -> None:
    from oneiter.judge.iteration.suggest import suggest_region

    found = suggest_region(result)
    if found is None:
        console.print("suggest: nothing diverged, no region to record", markup=False)
        return
    for line in found.lines(result.reference, result.target):
        console.print(terminal_text(line), markup=False)


def _emit_json(dest, document) -> None:
    """`--json FILE` writes the report (resolved by `oneiter.outputs`: whole or not at all for a file, directly to
    a device, FIFO or stdout); `document()` builds it."""
    if dest is None:
        return
    import json

    from oneiter.outputs import write_text

    write_text(dest, json.dumps(document(), indent=1, allow_nan=False) + "\n")
    _wrote(dest)


def _wrote(dest) -> None:
    """`wrote FILE` on stderr for a report written to a file or device (not for stdout, which the reader sees)."""
    if dest.kind != "stdout":
        err.print(f"wrote {terminal_text(dest.given)}", markup=False)


def run_compare(reference: Path, target: Optional[Path], *, rtol=None, atol=None, tolerances: Optional[Path] = None):
    """`oneiter.compare`, with its notes (a tolerance file for another device) printed once on stderr."""
    from oneiter.api import compare

    result = compare(reference, target, rtol=rtol, atol=atol, tolerances=tolerances)
    for note in result.notes:
        err.print(f"warning: {terminal_text(note)}", markup=False)
    return result


def _compare_ranks(reference: Path, target: Path, rtol, atol, tolerances, show_all: bool, json_dest,
                   to_stdout: bool) -> int:
    """Rank by rank (`oneiter.judge.iteration.ranks`, shown by `oneiter.report.rank_table`): overall verdict, one line
    per rank, reports; returns the exit code."""
    from oneiter.api import compare_ranks
    from oneiter.report.rank_table import print_ranked
    from oneiter.runtime.distributed import rank_info

    def report(result) -> None:
        set_outcome(result.exit_code)
        for note in result.notes:
            err.print(f"warning: {terminal_text(note)}", markup=False)
        print_ranked(err if to_stdout else out, result, show_all=show_all)
        _emit_json(json_dest, result.to_json)

    # under torchrun the processes share the rank pairs: process 0 reports, every process exits with its verdict
    result = compare_ranks(reference, target, rtol=rtol, atol=atol, tolerances=tolerances, processes=rank_info(),
                           report=report)
    return result if isinstance(result, int) else result.exit_code


def register(app: typer.Typer) -> None:
    """Add `compare` to the `oneiter` app."""
    app.command("compare", help=HELP, no_args_is_help=True)(compare)
