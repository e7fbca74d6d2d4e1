"""Where outputs go: a report path that is `/dev/stdout`, a symlink, a character device or a FIFO is written as it
is and keeps its type; `-` is stdout for --json and --csv; a directory, a missing folder or a link loop is one
line, exit 2; a recording (-o) goes to the regular file a symlink names and never to a device or a pipe.

Devices and FIFOs are made in tmp_path (`os.mknod` needs root: skipped otherwise); the real /dev is only read."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import pytest
from conftest import run_cli

from oneiter.outputs import OutputError, resolve

ROOT = Path(__file__).resolve().parents[2]


def one_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return lines[0]


def _shell(command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ONEITER_NO_PROGRESS": "1"}
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, env=env,
                          timeout=120)


def test_json_to_dev_stdout_reaches_the_pipe_and_dev_stdout_stays_a_link(files):
    ref, _, diverged = files
    py = sys.executable
    done = _shell(f"{py} -m oneiter compare {ref} {diverged} --json /dev/stdout | "
                  f"{py} -c 'import json,sys; d=json.load(sys.stdin); print(d[\"verdict\"][\"status\"])'")
    # exit 1 (the divergence) through pipefail; the reader parsed the JSON, the human report went to stderr
    assert (done.returncode, done.stdout.strip()) == (1, "diverged"), done.stderr
    assert "DIVERGED" in done.stderr and "wrote" not in done.stderr
    assert os.path.islink("/dev/stdout") and os.readlink("/dev/stdout") == "/proc/self/fd/1"


def test_a_symlink_to_proc_self_fd_1_is_stdout(files, tmp_path):
    ref, plain, _ = files
    link = tmp_path / "report.json"
    link.symlink_to("/proc/self/fd/1")
    for args in (("--json", link), ("--csv", link)):
        done = _shell(f"{sys.executable} -m oneiter compare {ref} {plain} {args[0]} {args[1]}")
        assert done.returncode == 0, done.stderr
        if args[0] == "--json":
            assert json.loads(done.stdout)["verdict"]["status"] == "match"
        else:
            rows = list(csv.DictReader(io.StringIO(done.stdout)))
            assert len(rows) == 26 and rows[0]["module"] == "(root)"
        assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"


def test_dash_is_stdout_for_json_and_csv_but_not_both(files):
    ref, plain, diverged = files
    res = run_cli("compare", ref, diverged, "--csv", "-")
    assert res.exit_code == 1
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert [r["status"] for r in rows].count("diverged") >= 1 and "DIVERGED" in res.stderr
    line = one_line(run_cli("compare", ref, plain, "--json", "-", "--csv", "-"))
    assert line == "error: --json and --csv both write to stdout: give them different destinations"
    line = one_line(run_cli("compare", ref, plain, "--html", "-"))
    assert line.startswith("error: --html '-': '-' (stdout) is taken by --json and --csv only")
    assert not Path("-").exists()


def _mknod_null(path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the null device, made here: the real /dev is not used
    return path


@pytest.mark.parametrize("option", ["--json", "--csv", "--html"])
def test_a_character_device_is_written_to_and_stays_a_device(files, tmp_path, option):
    ref, _, diverged = files
    node = _mknod_null(tmp_path / "null")
    res = run_cli("compare", ref, diverged, option, node)
    assert res.exit_code == 1, res.output
    assert stat.S_ISCHR(os.lstat(node).st_mode) and os.lstat(node).st_rdev == os.makedev(1, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["null"]  # no temporary file beside it


def test_replay_json_into_a_device_keeps_it_a_device(tmp_path, resnet_ref):
    node = _mknod_null(tmp_path / "null")
    res = run_cli("replay", resnet_ref, "--layer", "fc", "--json", node)
    assert res.exit_code == 0, res.output
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def _read_fifo(path: Path, into: list) -> threading.Thread:
    def read():
        with open(path, "rb") as fh:
            into.append(fh.read())
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("option", ["--json", "--csv", "--html"])
def test_a_fifo_gets_the_report_and_stays_a_fifo(files, tmp_path, option):
    ref, _, diverged = files
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    res = run_cli("compare", ref, diverged, option, fifo)
    reader.join(30)
    assert res.exit_code == 1, res.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    text = got[0].decode()
    if option == "--json":
        assert json.loads(text)["verdict"]["status"] == "diverged"
    elif option == "--csv":
        assert text.startswith("index,module,call,phase,tensor,status")
    else:
        assert text.startswith("<!DOCTYPE html>")


def test_a_symlink_to_a_file_is_written_through_and_stays_a_link(files, tmp_path):
    ref, plain, _ = files
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old\n")
    link.symlink_to(real)
    assert run_cli("compare", ref, plain, "--json", link).exit_code == 0
    assert link.is_symlink() and json.loads(real.read_text())["verdict"]["status"] == "match"
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "made.json")  # a link to a file not there yet, in an existing folder
    assert run_cli("compare", ref, plain, "--html", dangling).exit_code == 0
    assert dangling.is_symlink() and (tmp_path / "made.json").read_text().startswith("<!DOCTYPE html>")


def test_unwritable_destinations_are_one_line_exit_2(files, tmp_path):
    ref, plain, _ = files
    loop = tmp_path / "loop.json"
    loop.symlink_to(tmp_path / "loop2.json")
    (tmp_path / "loop2.json").symlink_to(loop)
    nowhere = tmp_path / "nowhere.json"
    nowhere.symlink_to(tmp_path / "missing" / "x.json")
    assert one_line(run_cli("compare", ref, plain, "--json", tmp_path)) == (
        f"error: --json '{tmp_path}': is a directory, expected a file path")
    assert one_line(run_cli("compare", ref, plain, "--csv", loop)).endswith("symbolic links to follow (a loop?)")
    assert one_line(run_cli("compare", ref, plain, "--html", nowhere)) == (
        f"error: --html '{nowhere}': folder '{tmp_path / 'missing'}' does not exist")
    assert "would overwrite the input recording" in one_line(run_cli("compare", ref, plain, "--json", plain))
    sock_dir = tmp_path / "tb_file"
    sock_dir.write_text("a file, not a folder")
    assert one_line(run_cli("compare", ref, plain, "--tensorboard", sock_dir)) == (
        f"error: --tensorboard '{sock_dir}': exists and is not a directory; give a folder")
    assert sock_dir.read_text() == "a file, not a folder"
    assert not nowhere.exists() and loop.is_symlink()


def test_a_profile_folder_that_is_a_device_or_holds_planted_links_is_refused(tmp_path):
    fifo = tmp_path / "prof"
    os.mkfifo(fifo)
    line = one_line(run_cli("profile", "--model", "resnet18", "-o", fifo))
    assert line == f"error: --out '{fifo}': exists and is not a directory; give a folder"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    from oneiter.outputs import file_in

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "summary.json").symlink_to("/dev/null")
    with pytest.raises(OutputError, match="exists and is not a regular file"):
        file_in(tmp_path / "dir", "summary.json", "--out")


def test_a_recording_goes_to_the_file_a_symlink_names(tmp_path):
    from conftest import record_small

    real, link = tmp_path / "real.h5", tmp_path / "run.h5"
    link.symlink_to(real)
    record_small(link, "llama_tiny")
    assert link.is_symlink() and h5py.is_hdf5(real)
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    assert "is a FIFO (named pipe), not a regular file" in one_line(
        run_cli("record", "--model", "llama_tiny", "-o", fifo))
    with pytest.raises(OutputError, match="names file descriptor 1"):
        resolve("/dev/stdout", "out", streams=False)
