"""One voice on stderr: every warning is one `warning: ...` line, with no file:line or source line, and above a
running progress bar, never inside it (`oneiter/errors.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from conftest import run_cli

from oneiter.errors import OneIterWarning, one_line_warnings, warn

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_tensorboard_into_one_folder_is_one_warning_line(resnet_ref, tmp_path):
    run_cli("compare", resnet_ref, resnet_ref, "--tensorboard", tmp_path / "tb")
    res = run_cli("compare", resnet_ref, resnet_ref, "--tensorboard", tmp_path / "tb")
    assert res.exit_code == 0
    lines = [line for line in res.stderr.splitlines() if "already holds event files" in line]
    assert lines == [f"warning: {tmp_path / 'tb'} already holds event files: TensorBoard will mix this comparison "
                     f"with them (write each comparison into its own folder)"]
    assert "warnings.warn" not in res.stderr and ".py:" not in res.stderr  # no source line, no location


def _script(code: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh Python, as a user's script: its warnings shown by Python's own display (pytest records
    the warnings of its tests instead of showing them); stderr decoded as it was written, carriage returns kept."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    done.stderr = done.stderr.decode()
    return done


def test_library_warnings_are_oneiter_warnings_shown_as_one_line():
    done = _script("""
        import warnings
        from oneiter.errors import warn
        warnings.simplefilter("always")
        warn("something legal but misleading\\n  over two lines")
    """)
    assert done.returncode == 0 and done.stderr == "warning: something legal but misleading over two lines\n"
    with pytest.warns(OneIterWarning, match="filterable"):  # still a Python warning: filters and pytest see it
        warn("filterable")


def test_in_the_cli_every_warning_is_one_line(capsys):
    with one_line_warnings():
        warnings.simplefilter("always")
        warnings.warn("a model's own warning", stacklevel=1)
        warnings.warn("torch is old", DeprecationWarning, stacklevel=1)
    assert capsys.readouterr().err == ("warning: a model's own warning\n"
                                       "warning: torch is old (DeprecationWarning)\n")


def test_a_warning_goes_above_a_running_tqdm_bar():
    pytest.importorskip("tqdm")
    done = _script("""
        import sys, warnings
        import tqdm
        from oneiter.errors import warn
        warnings.simplefilter("always")
        with tqdm.tqdm(total=3, file=sys.stderr, ascii=True, mininterval=0) as bar:
            bar.update(1)
            warn("the optimizer has state")
            bar.update(2)
    """)
    text = done.stderr
    # tqdm.write blanks the bar's line first, so the warning starts a line of its own; the bar is drawn again after
    before, found, after = text.partition("\rwarning: the optimizer has state\n")
    assert found and before.rstrip(" ").endswith("\r") and "1/3" in before and "3/3" in after, repr(text)
