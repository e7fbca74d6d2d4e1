"""The profile directory: `summary.json` (format, writing, reading) and the guard against mixing two runs in one.

Where it sits: the runner prepares the directory before profiling and rewrites `summary.json` after every cycle
(an interrupted run still leaves a readable summary of the cycles it finished); `diff.py` and users read it back.

`summary.json` holds the run's settings, one entry per cycle (`steps`, `trace`, `ops`, `memory`, `modules`, ...),
the overhead measurement, notes, warnings, and `files`: everything oneiter wrote to the directory, which is what
`--force` removes before a new run. Nothing else in the directory is ever deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from oneiter.errors import FormatError, OneIterError
from oneiter.outputs import file_in, resolve_folder

__all__ = ["SUMMARY_NAME", "FORMAT", "check_out_dir", "prepare_out_dir", "write_summary", "read_summary"]

SUMMARY_NAME = "summary.json"
FORMAT = "oneiter.profile/1"
_OURS = ("*_rank*_steps*.pt.trace.json.gz", "*_rank*_steps*.tables.txt", "*_rank*_steps*.memory_snapshot.pickle")


def _previous_files(out_dir: Path) -> list[Path]:
    found: set[Path] = set()
    summary = out_dir / SUMMARY_NAME
    if summary.is_file():
        try:
            data = json.loads(summary.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("format") == FORMAT:
            found.add(summary)
            found.update(out_dir / name for name in data.get("files", []) if "/" not in name and name != "..")
    for pattern in _OURS:
        found.update(out_dir.glob(pattern))
    return sorted(p for p in found if p.is_file())


def check_out_dir(out_dir: Path, force: bool) -> list[Path]:
    """Refuse an output that is a file, or a directory holding a previous oneiter profile unless `force`;
    return the previous profile's files (what `prepare_out_dir` removes). Creates nothing."""
    out_dir = resolve_folder(out_dir, "--out")  # a folder through links; a file, device or dangling link refused
    previous = _previous_files(out_dir) if out_dir.is_dir() else []
    if previous and not force:
        raise OneIterError(
            f"output directory '{out_dir}' already holds a oneiter profile ({previous[0].name}, "
            f"{len(previous)} file(s)); pass --force to replace it, or choose another -o/--out"
        )
    return previous


def prepare_out_dir(out_dir: Path, force: bool) -> Path:
    """Create `out_dir`; refuse one holding a previous oneiter profile unless `force`, which removes its files
    (and nothing else)."""
    out_dir = Path(out_dir)
    previous = check_out_dir(out_dir, force)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in previous:
        os.unlink(path)
    return out_dir


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    """Write `summary.json` atomically (a reader never sees half a file)."""
    path = file_in(out_dir, SUMMARY_NAME, "--out")
    tmp = file_in(out_dir, f".{SUMMARY_NAME}.tmp", "--out")
    tmp.write_text(json.dumps(summary, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_summary(profile_dir: Path) -> dict[str, Any]:
    """Load and check a profile directory's `summary.json` (a path to the file itself is accepted too)."""
    path = Path(profile_dir)
    if path.is_dir():
        path = path / SUMMARY_NAME
    if not path.is_file():
        raise FormatError(f"'{profile_dir}' is not a oneiter profile: {path} does not exist (run `oneiter profile`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise FormatError(f"'{path}' is not valid JSON ({exc}); is the profile complete?") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise FormatError(f"'{path}' is not a oneiter profile summary: expected format {FORMAT}, got {found!r}")
    if not data.get("cycles"):
        raise FormatError(f"'{path}' holds no finished profiling cycle; the run was interrupted before its first trace")
    return data
