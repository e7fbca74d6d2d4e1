"""One voice on stderr: every warning is one `warning: ...` line, with no file:line or source line, and above a
running progress bar, never inside it (`oneiter/errors.py`)."""

from __future__ import annotations

import io
import warnings

import pytest
from conftest import run_cli

from oneiter.errors import OneIterWarning, one_line_warnings, warn


def test_a_second_tensorboard_into_one_folder_is_one_warning_line(resnet_ref, tmp_path):
    run_cli("compare", resnet_ref, resnet_ref, "--tensorboard", tmp_path / "tb")
    res = run_cli("compare", resnet_ref, resnet_ref, "--tensorboard", tmp_path / "tb")
    assert res.exit_code == 0
    lines = [line for line in res.stderr.splitlines() if "already holds event files" in line]
    assert lines == [f"warning: {tmp_path / 'tb'} already holds event files: TensorBoard will mix this comparison "
                     f"with them (write each comparison into its own folder)"]
    assert "warnings.warn" not in res.stderr and ".py:" not in res.stderr  # no source line, no location


def test_library_warnings_are_oneiter_warnings_shown_as_one_line(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = warnings._showwarning_orig  # Python's own display, as a user's script has it
        warn("something legal but misleading\n  over two lines")
        print_err = capsys.readouterr().err
    assert print_err == "warning: something legal but misleading over two lines\n"
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
    tqdm = pytest.importorskip("tqdm")
    stream = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = warnings._showwarning_orig
        with tqdm.tqdm(total=3, file=stream, ascii=True, mininterval=0) as bar:
            bar.update(1)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("sys.stderr", stream)
                warn("the optimizer has state")
            bar.update(2)
    text = stream.getvalue()
    # tqdm.write blanks the bar's line first, so the warning starts a line of its own; the bar is drawn again after
    before, found, after = text.partition("\rwarning: the optimizer has state\n")
    assert found and before.rstrip(" ").endswith("\r") and "1/3" in before and "3/3" in after, repr(text)
