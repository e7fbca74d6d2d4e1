"""Exit codes beyond the verdict: 3 for an internal error, a closed stdout pipe is no error, reports written whole."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]

INTERNAL = ("error: internal error: RuntimeError: boom — please report it at the oneiter issue tracker; "
            "ONEITER_TRACEBACK=1 shows the traceback")


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


def test_a_bug_is_exit_3_with_one_line(files, monkeypatch):
    ref, plain, _ = files
    monkeypatch.delenv("ONEITER_TRACEBACK", raising=False)
    monkeypatch.setattr("oneiter.report.terminal.print_report", _boom)
    res = run_cli("compare", ref, plain)
    assert res.exit_code == 3 and res.stderr.strip() == INTERNAL and "Traceback" not in res.output
    monkeypatch.setattr("oneiter.format.inspection.summarize_file", _boom)
    res = run_cli("inspect", ref)
    assert res.exit_code == 3 and res.stderr.strip() == INTERNAL


def test_oneiter_traceback_shows_the_traceback_and_keeps_the_exit_code(files, monkeypatch):
    ref, plain, _ = files
    monkeypatch.setenv("ONEITER_TRACEBACK", "1")
    monkeypatch.setattr("oneiter.report.terminal.print_report", _boom)
    res = run_cli("compare", ref, plain)
    assert res.exit_code == 3
    assert res.stderr.startswith("Traceback (most recent call last):") and "RuntimeError: boom" in res.stderr
    assert res.stderr.strip().splitlines()[-1] == INTERNAL
    res = run_cli("inspect", ref.parent / "missing.h5")  # a user error keeps its code 2 with the traceback on
    assert res.exit_code == 2 and "Traceback" in res.stderr and "does not exist" in res.stderr


def test_usage_errors_and_verdicts_are_not_internal_errors(files):
    ref, plain, diverged = files
    assert run_cli("compare", ref, plain).exit_code == 0
    assert run_cli("compare", ref, diverged).exit_code == 1
    res = run_cli("compare", ref, plain, "--rtol", "-1")
    assert res.exit_code == 2 and "internal error" not in res.output


def _oneiter(*args) -> list[str]:
    return [sys.executable, "-m", "oneiter", *map(str, args)]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), ONEITER_NO_PROGRESS="1")
    env.pop("ONEITER_TRACEBACK", None)
    return env


@pytest.mark.parametrize("which, code", [("diverged", 1), ("plain", 0)])
def test_a_reader_that_goes_away_is_not_a_divergence(files, which, code):
    """`oneiter compare a b | head -1`: the pipe's reader is gone before oneiter prints; it exits with the
    verdict's code, quietly (no traceback, no 'Exception ignored' at shutdown)."""
    ref, plain, diverged = files
    target = diverged if which == "diverged" else plain
    proc = subprocess.Popen(_oneiter("compare", ref, target, "--all"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    proc.stdout.close()  # before the report: every write of it meets a closed pipe (EPIPE)
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == code, stderr
    # nothing but the note that a plain recording (no --replay) differs from the reference
    assert all(line.startswith("warning: ") and "is not a replay" in line for line in stderr.splitlines())
    assert stderr.count("\n") == (1 if which == "diverged" else 0)


def test_broken_pipe_through_a_shell_pipeline(files):
    ref, _, diverged = files
    command = " ".join(map(str, _oneiter("compare", ref, diverged, "--all")))
    script = f"set -o pipefail; {command} 2>err.txt | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}}"
    folder = diverged.parent  # not the folder of the shared recordings: they are only read
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=_env(), cwd=folder,
                          timeout=120)
    assert done.stdout.strip() == "1"
    assert "Traceback" not in (folder / "err.txt").read_text() and "Broken pipe" not in (folder / "err.txt").read_text()


# -- reports written whole or not at all ----------------------------------------------------------------------------
def _no_temporaries(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("option", ["--json", "--csv", "--html"])
def test_a_failed_report_write_leaves_no_file_and_keeps_the_old_one(files, tmp_path, monkeypatch, option):
    ref, _, diverged = files

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("oneiter.outputs.os.fsync", full_disk)
    out = tmp_path / "report.out"
    res = run_cli("compare", ref, diverged, option, out)
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-1] == "error: [Errno 28] No space left on device"
    assert not out.exists()
    _no_temporaries(tmp_path)
    out.write_text("the previous report\n")
    assert run_cli("compare", ref, diverged, option, out).exit_code == 2
    assert out.read_text() == "the previous report\n"
    _no_temporaries(tmp_path)
    monkeypatch.undo()
    assert run_cli("compare", ref, diverged, option, out).exit_code == 1
    assert out.stat().st_size > 100 and out.read_text() != "the previous report\n"
    _no_temporaries(tmp_path)


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))


def test_a_file_size_limit_leaves_no_0_byte_json(files, tmp_path):
    ref, _, diverged = files
    out = tmp_path / "report.json"
    done = subprocess.run(_oneiter("compare", ref, diverged, "--json", out), capture_output=True, text=True,
                          env=_env(), cwd=ROOT, preexec_fn=_limit_file_size, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "error: [Errno 27] File too large"
    assert not out.exists()
    _no_temporaries(tmp_path)
