"""`oneiter compare REF TARGET`: the CLI face of `oneiter.judge` — options in, report out, exit code.

Thin on purpose: the work is in `oneiter.judge.engine` (and `report` for output; `ranks` for the files of a
multi-rank run). torch/numpy are imported inside the command so `oneiter --help` stays fast. Exit codes: 0 match,
1 divergence, 2 bad input or inconclusive (the result's `exit_code`), 3 an internal error. Report files are
written atomically (`report.atomic`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from oneiter.cli.common import err, handle_errors, out, set_outcome, terminal_text
from oneiter.errors import OneIterError

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
    "Multi-rank runs (torchrun ... record -o ref.h5 writes ref.rank0.h5, ref.rank1.h5, ...): give two directories, "
    "or the names given to -o; files are paired by rank and compared in parallel processes, with one verdict per "
    "rank and an overall one naming the rank. A rank missing on one side exits 2.",
    "[bold]Examples[/]",
    "  oneiter compare cpu.h5 cuda.h5",
    "  oneiter compare cpu.h5 npu.h5 --rtol 1e-4 --json report.json",
    "  oneiter compare cpu.h5 npu.h5 --all --csv rows.csv",
    "  oneiter compare ref.h5 tgt.h5   [dim](ref.rank*.h5 vs tgt.rank*.h5 when ref.h5 does not exist)[/dim]",
    "  oneiter compare ref_dir/ tgt_dir/ --json -",
])

Reference = Annotated[
    Path,
    typer.Argument(metavar="REF", show_default=False,
                   help="The reference recording (.h5), e.g. made on CPU; or a multi-rank run (directory, -o name)."),
]
Target = Annotated[
    Path,
    typer.Argument(metavar="TARGET", show_default=False,
                   help="The recording to judge against it (.h5), or a multi-rank run."),
]
Rtol = Annotated[Optional[float], typer.Option("--rtol", min=0.0, help="Relative tolerance for every entry.")]
Atol = Annotated[Optional[float], typer.Option("--atol", min=0.0, help="Absolute tolerance for every entry.")]
ShowAll = Annotated[bool, typer.Option("--all", help="Show every entry, not only those around the divergence.")]
JsonOut = Annotated[
    Optional[Path], typer.Option("--json", metavar="FILE", help="Write the full report as JSON ('-': stdout).")
]
CsvOut = Annotated[Optional[Path], typer.Option("--csv", metavar="FILE", help="Write one CSV line per entry.")]
Tolerances = Annotated[
    Optional[Path],
    typer.Option("--tolerances", metavar="FILE", help=
            "Per-device tolerance file: .toml (data), or an mmengine .py config, which is Python code and is "
            "executed."),
]
HtmlOut = Annotated[Optional[Path], typer.Option("--html", metavar="FILE", help="Write a self-contained HTML report.")]
TbOut = Annotated[
    Optional[Path], typer.Option("--tensorboard", metavar="DIR", help="Write TensorBoard error curves and histograms.")
]


def _check_output(option: str, path: Optional[Path], inputs: tuple[Path, ...]) -> None:
    """Refuse an output path that is one of the inputs, or whose folder does not exist."""
    if path is None or str(path) == "-":
        return
    for given in inputs:
        same = path.resolve() == given.resolve() or (path.exists() and given.exists() and os.path.samefile(path, given))
        if same:
            raise OneIterError(f"{option} {path} would overwrite the input recording '{given}': choose another file")
    if path.is_dir():
        raise OneIterError(f"{option} {path} is a directory, expected a file path")
    if not path.resolve().parent.is_dir():
        raise OneIterError(f"{option} {path}: folder '{path.parent}' does not exist")


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
    suggest: Annotated[bool, typer.Option("--suggest", help=
            "Print the --include that records the first divergence's region in full (after a --level stats "
            "screening).")] = False,
) -> None:
    """The `compare` command; see HELP."""
    from oneiter.judge.ranks import is_ranked
    from oneiter.report import terminal as report

    inputs = (reference,) if target is None else (reference, target)
    outputs = [("--json", json_path), ("--csv", csv_path), ("--html", html_path)]
    for option, path in outputs:
        _check_output(option, path, inputs)
    json_to_stdout = json_path is not None and str(json_path) == "-"
    files = [p.resolve() for _, p in outputs if p is not None and str(p) != "-"]
    if len(files) != len(set(files)):
        raise OneIterError("--json, --csv and --html must write to different files")
    if target is not None and (is_ranked(reference) or is_ranked(target)):
        unsupported = [o for o, p in [*outputs[1:], ("--tensorboard", tb_dir)] if p is not None]
        if unsupported:
            raise OneIterError(f"{unsupported[0]} takes one pair of files: give one rank's files, e.g. a.rank1.h5")
        raise typer.Exit(_compare_ranks(reference, target, rtol, atol, tolerances, show_all, json_path))

    result = run_compare(reference, target, rtol=rtol, atol=atol, tolerances=tolerances)
    set_outcome(result.exit_code)  # the exit code if the reader of stdout goes away while we print

    # with `--json -` stdout carries only the JSON, so the human report moves to stderr
    report.print_report(err if json_to_stdout else out, result, show_all=show_all)
    _emit_json(json_path, result.to_json)
    if csv_path is not None:
        report.write_csv(result, csv_path)
        err.print(f"wrote {csv_path}", markup=False)
    if html_path is not None:
        from oneiter.report.html import write_html

        write_html(result, html_path)
        err.print(f"wrote {html_path}", markup=False)
    if tb_dir is not None:
        from oneiter.report.tensorboard import write_tensorboard

        event_file = write_tensorboard(result, tb_dir, result.reference, result.target)
        err.print(f"wrote {event_file} (view: tensorboard --logdir {tb_dir})", markup=False)
    if suggest:
        _print_suggestion(result, err if json_to_stdout else out)
    raise typer.Exit(result.exit_code)


def _print_suggestion(result, console) -> None:
    from oneiter.judge.suggest import suggest_region

    found = suggest_region(result)
    if found is None:
        console.print("suggest: nothing diverged, no region to record", markup=False)
        return
    for line in found.lines(result.reference, result.target):
        console.print(terminal_text(line), markup=False)


def _emit_json(json_path: Optional[Path], document) -> None:
    """`--json FILE` writes the report; `--json -` prints it alone on stdout. `document()` builds it."""
    if json_path is None:
        return
    import json

    text = json.dumps(document(), indent=1, allow_nan=False)
    if str(json_path) == "-":
        out.out(text, highlight=False)
        return
    from oneiter.report.atomic import write_text_atomic

    write_text_atomic(json_path, text + "\n")  # whole or not at all: never a 0-byte report
    err.print(f"wrote {json_path}", markup=False)


def run_compare(reference: Path, target: Optional[Path], *, rtol=None, atol=None, tolerances: Optional[Path] = None):
    """`oneiter.compare`, with its notes (a tolerance file for another device) printed once on stderr."""
    from oneiter.api import compare

    result = compare(reference, target, rtol=rtol, atol=atol, tolerances=tolerances)
    for note in result.notes:
        err.print(f"warning: {terminal_text(note)}", markup=False)
    return result


def _compare_ranks(reference: Path, target: Path, rtol, atol, tolerances, show_all: bool, json_path) -> int:
    """Rank by rank (`oneiter.judge.ranks`, shown by `oneiter.report.ranks`): overall verdict, one line per rank,
    reports; returns the exit code."""
    from oneiter.api import compare_ranks
    from oneiter.report.ranks import print_ranked

    result = compare_ranks(reference, target, rtol=rtol, atol=atol, tolerances=tolerances)
    set_outcome(result.exit_code)
    for note in result.notes:
        err.print(f"warning: {terminal_text(note)}", markup=False)
    json_to_stdout = json_path is not None and str(json_path) == "-"
    print_ranked(err if json_to_stdout else out, result, show_all=show_all)
    _emit_json(json_path, result.to_json)
    return result.exit_code


def register(app: typer.Typer) -> None:
    """Add `compare` to the `oneiter` app."""
    app.command("compare", help=HELP, no_args_is_help=True)(compare)
