"""Writing a recording: a full disk, SIGTERM, stale temporary files, outputs that must not be written."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import MODEL_FILES, run_cli

_RECORD = ["-m", "oneiter", "record", "--model", "resnet18", "--model-arg", "image_size=32", "-b", "2"]


def _limited(limit: int):
    """preexec_fn: a file size limit (writes beyond it fail with EFBIG, as on a full disk)."""
    def apply():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("limit_mb", [1, 8, 60])
def test_a_full_disk_is_one_line_exit_2_and_leaves_nothing(tmp_path, limit_mb):
    # 1 MB fails while state_before is written (inside the Recorder's enter), 8 and 60 MB during the iteration
    out = tmp_path / "out.h5"
    proc = subprocess.run([sys.executable, *_RECORD, "-o", str(out)], capture_output=True, text=True,
                          preexec_fn=_limited(limit_mb << 20), timeout=300,
                          env={**os.environ, "ONEITER_NO_PROGRESS": "1"})
    assert proc.returncode == 2, proc.stderr
    *notes, last = proc.stderr.strip().splitlines()
    assert last == (f"error: no space left to write the recording in '{tmp_path}' (File too large); nothing was "
                    f"written: free space or write it elsewhere")
    assert all(note.startswith("forward recorded: the file will be about") for note in notes) and len(notes) <= 1
    assert list(tmp_path.iterdir()) == []


def test_sigterm_removes_the_temporary_file(tmp_path):
    """The model file's forward announces itself and waits, so the signal lands inside the iteration, with the
    temporary file open, however fast or loaded the machine (a timed window once closed before the signal came)."""
    out, ready = tmp_path / "out.h5", tmp_path.parent / f"{tmp_path.name}.ready"
    env = {**os.environ, "ONEITER_TEST_READY": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "oneiter", "record", "--model", f"{MODEL_FILES / 'waits.py'}:build",
                             "-b", "4", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), f"the model never ran: {proc.stderr.read() if proc.poll() is not None else 'timeout'}"
    assert list(tmp_path.glob(".out.h5.tmp-*")), "the record was not writing"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path, resnet_ref):
    host = socket.gethostname()
    dead = tmp_path / f".out.h5.tmp-{host}-999999999"
    other_host = tmp_path / ".out.h5.tmp-some-other-node-12"
    alive = tmp_path / f".out.h5.tmp-{host}-{os.getppid()}"
    for path in (dead, other_host, alive):
        path.write_bytes(b"partial")
    from oneiter.record.session import remove_stale_temps

    assert remove_stale_temps(tmp_path / "out.h5") == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other_host.name, alive.name])


def test_outputs_that_are_inputs_or_not_regular_files_are_refused(tmp_path, resnet_ref):
    before = resnet_ref.read_bytes()
    res = run_cli("record", "--replay", resnet_ref, "-o", resnet_ref, "--force")
    assert res.exit_code == 2 and "is the reference being replayed" in res.stderr
    assert resnet_ref.read_bytes() == before
    res = run_cli("record", "--model", "resnet18", "-o", "/dev/null", "--force")
    assert res.exit_code == 2 and "--out '/dev/null': is a character device, not a regular file" in res.stderr
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    res = run_cli("record", "--model", "resnet18", "-o", fifo, "--force")
    assert res.exit_code == 2 and "is a FIFO (named pipe), not a regular file" in res.stderr


def test_record_refuses_when_the_filesystem_lacks_the_space(tmp_path, monkeypatch):
    """Up front: the model's state and gradients the file stores in full; after forward: the whole file."""
    import shutil

    from conftest import record_small

    from oneiter.errors import OneIterError

    real = shutil.disk_usage
    free = {"bytes": 1_000_000, "later": None}

    def usage(path):  # the first call sees `bytes` free, later ones `later` (as if the start had used it up)
        value, free["bytes"] = free["bytes"], free["later"] or free["bytes"]
        return real(path)._replace(free=value)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    with pytest.raises(OneIterError, match=r"needs at least \(the model's state and gradients it stores in full\) "
                                           r"134\.3 MB, and '.*' has 1\.0 MB free"):
        record_small(tmp_path / "a.h5")
    free.update(bytes=140_000_000, later=20_000_000)  # the state fits, the rest of the file does not
    notes = []
    with pytest.raises(OneIterError, match=r"needs about \(forward measured, backward estimated\) 1[0-9]{2}\.\d MB"):
        from oneiter.record.run import SpecOptions, record

        record(SpecOptions(out=tmp_path / "a.h5", model="resnet18", batch_size=2,
                             model_args={"image_size": 32, "num_classes": 10}), notify=notes.append)
    assert notes and notes[0].startswith("forward recorded: the file will be about ")
    assert list(tmp_path.iterdir()) == []
    free.update(bytes=10**12, later=10**12)
    summary = record(SpecOptions(out=tmp_path / "a.h5", model="resnet18", batch_size=2,
                                   model_args={"image_size": 32, "num_classes": 10}), notify=notes.append)
    estimate = float(notes[-1].split("about ")[1].split(" MB")[0]) * 1e6
    assert 1.0 <= estimate / summary.file_bytes <= 1.15  # the estimate errs on the safe side, by little
