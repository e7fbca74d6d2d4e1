"""`oneiter compare REF TARGET`: the CLI face of `oneiter.compare` — options in, report out, exit code.

Thin on purpose: the work is in `oneiter.compare.engine` (and `report` for output; `ranks` for the files of a
multi-rank run). torch/numpy are imported inside the command so `oneiter --help` stays fast. Exit codes: 0 match,
1 divergence, 2 bad input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import OneIterError
from .common import EXIT_DIVERGED, EXIT_MATCH, err, handle_errors, out

__all__ = ["compare", "register"]

HELP = "\n\n".join([
    "Compare two recordings of one training iteration and name the module call whose own computation differs "
    "(with local data from `record --replay` or `--against cpu`), else the first entry that diverges.",
    "Entries are paired by module path, call index and tensor name, and walked in causal order: forward as "
    "executed, backward as the gradients were computed, then parameter gradients, then updated parameters. "
    "An entry present on one side only, or with another shape or dtype, is a divergence, never a pass.",
    "Default tolerances are torch.testing.assert_close's for each dtype (float32: rtol 1.3e-6, atol 1e-5); "
    "--rtol / --atol replace them. Exit code: 0 match, 1 divergence, 2 bad input.",
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
    typer.Option("--tolerances", metavar="FILE", help="Per-device tolerance file (.toml or mmengine .py config)."),
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
) -> None:
    """The `compare` command; see HELP."""
    from ..compare import report
    from ..compare.ranks import is_ranked

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

    # with `--json -` stdout carries only the JSON, so the human report moves to stderr
    report.print_report(err if json_to_stdout else out, result, show_all=show_all)
    _emit_json(json_path, lambda: report.to_json(result))
    if csv_path is not None:
        report.write_csv(result, csv_path)
        err.print(f"wrote {csv_path}", markup=False)
    if html_path is not None:
        from ..compare.html_report import write_html

        write_html(report.to_json(result), html_path)
        err.print(f"wrote {html_path}", markup=False)
    if tb_dir is not None:
        from ..compare.tb_report import write_tensorboard

        event_file = write_tensorboard(result, tb_dir, result.reference, result.target)
        err.print(f"wrote {event_file} (view: tensorboard --logdir {tb_dir})", markup=False)
    raise typer.Exit(EXIT_MATCH if result.status == "match" else EXIT_DIVERGED)


def _emit_json(json_path: Optional[Path], document) -> None:
    """`--json FILE` writes the report; `--json -` prints it alone on stdout. `document()` builds it."""
    if json_path is None:
        return
    import json

    text = json.dumps(document(), indent=1, allow_nan=False)
    if str(json_path) == "-":
        out.out(text, highlight=False)
        return
    Path(json_path).write_text(text + "\n", encoding="utf-8")
    err.print(f"wrote {json_path}", markup=False)


def run_compare(reference: Path, target: Optional[Path], *, rtol=None, atol=None, tolerances: Optional[Path] = None):
    """Build the policies (tolerance file, --atol/--rtol) and compare two files, or judge one --against file."""
    from ..compare.engine import compare_files, compare_local

    spec, policies = _policies(rtol, atol, tolerances)
    if target is None:
        result = compare_local(reference, **policies)
    else:
        result = compare_files(reference, target, **policies)
    _warn_device(spec, [result.meta_target])
    return result


def _policies(rtol, atol, tolerances: Optional[Path]) -> tuple[Any, dict]:
    """The tolerance file (or None) and compare_files' keyword arguments: --rtol/--atol, the file's policy and
    noise settings."""
    spec = policy = noise = None
    if tolerances is not None:
        from ..compare.tolerance_file import FileTolerance, load_tolerance_file

        spec = load_tolerance_file(tolerances)
        policy, noise = FileTolerance(spec, atol=atol, rtol=rtol), spec.noise
    return spec, {"rtol": rtol, "atol": atol, "tolerance": policy, "noise": noise}


def _warn_device(spec, metas: list[dict]) -> None:
    """A tolerance file written for another device type than the target's: say so once, on stderr."""
    if spec is None:
        return
    notes = {spec.device_mismatch(meta.get("device")) for meta in metas} - {None}
    for note in sorted(notes):
        err.print(f"warning: {note}", markup=False)


def _compare_ranks(reference: Path, target: Path, rtol, atol, tolerances, show_all: bool, json_path) -> int:
    """Rank by rank (`oneiter.compare.ranks`): overall verdict, one line per rank, reports; returns the exit code."""
    from ..compare import ranks

    spec, policies = _policies(rtol, atol, tolerances)
    result = ranks.compare_ranks(reference, target, **policies)
    _warn_device(spec, [r.meta_target for r in result.results.values()])
    json_to_stdout = json_path is not None and str(json_path) == "-"
    ranks.print_ranked(err if json_to_stdout else out, result, show_all=show_all)
    _emit_json(json_path, lambda: ranks.to_json(result))
    return EXIT_MATCH if result.status == "match" else EXIT_DIVERGED


def register(app: typer.Typer) -> None:
    """Add `compare` to the `oneiter` app."""
    app.command("compare", help=HELP, no_args_is_help=True)(compare)
