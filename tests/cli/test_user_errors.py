"""An exception of the user's own model, in forward or in backward, is bad input (exit 2, one line naming the module
call, the phase, the user's line and the exception); a bug of oneiter stays exit 3 (`errors.user_code`,
`record/capture/raised_at.py`). The model file is tests/model_files/user_errors.py (mode by --model-arg or its env
variable)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MODEL_FILES, run_cli

from oneiter.errors import UserCodeError

MODEL = (MODEL_FILES / "user_errors.py").resolve()
SPEC = f"{MODEL}:build"
ENGINE = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
          "[torch.FloatTensor [2, 16]], which is output 0 of Sigmoid, is at version 1; expected version 0 instead.")


def _line_of(text: str) -> int:
    """The line of the model file that holds `text` (once)."""
    found = [i for i, line in enumerate(MODEL.read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, found
    return found[0]


EXPECTED = {
    "forward_shape": ("error: the forward of layers.1.mlp@0 raised RuntimeError: mat1 and mat2 shapes cannot be "
                      f"multiplied (2x15 and 16x8) (at {MODEL}:{_line_of('h[..., :-1]')}, in forward, calling "
                      "layers.1.mlp.down@0; ONEITER_TRACEBACK=1 shows the traceback)"),
    "backward_inplace": (f"error: the backward of layers.1.mlp@0 raised RuntimeError: {ENGINE} (its node "
                         f"SigmoidBackward0 was created at {MODEL}:{_line_of('torch.sigmoid(h)')}, in forward; "
                         "ONEITER_TRACEBACK=1 shows the traceback)"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A clean recording of the same model file (no mode)."""
    out = tmp_path_factory.mktemp("user_errors") / "ref.h5"
    res = run_cli("record", "--model", SPEC, "-b", "2", "-o", out)
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    monkeypatch.delenv("ONEITER_TRACEBACK", raising=False)
    monkeypatch.delenv("ONEITER_TEST_USER_ERROR", raising=False)


def _assert_one_error_line(res, expected: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [expected]
    # besides it, only the size note printed once forward is done
    assert all(line.startswith("forward recorded: ") for line in lines if line != expected), lines
    assert "Traceback" not in res.output and "internal error" not in res.output


@pytest.mark.parametrize("mode", ["forward_shape", "backward_inplace"])
def test_the_users_error_is_exit_2_naming_call_phase_and_line(tmp_path, mode):
    out = tmp_path / "out.h5"
    res = run_cli("record", "--model", SPEC, "--model-arg", f"mode={mode}", "-b", "2", "-o", out)
    _assert_one_error_line(res, EXPECTED[mode])
    assert not out.exists()


@pytest.mark.parametrize("mode", ["forward_shape", "backward_inplace"])
def test_the_same_in_a_replay_of_a_clean_reference(tmp_path, reference, mode):
    """The probes rerun every finished call (and create autograd nodes of their own): the live call's error is
    still the one named, and backward's node is still traced to its line."""
    out = tmp_path / "replay.h5"
    res = run_cli("record", "--model", SPEC, "--replay", reference, "--model-arg", f"mode={mode}", "-o", out)
    _assert_one_error_line(res, EXPECTED[mode])
    assert not out.exists()


def test_the_python_api_raises_user_code_error(tmp_path, monkeypatch):
    from oneiter.record.run import SpecOptions, record

    monkeypatch.setenv("ONEITER_TEST_USER_ERROR", "backward_inplace")
    with pytest.raises(UserCodeError) as caught:
        record(SpecOptions(out=tmp_path / "api.h5", model=SPEC, batch_size=2))
    assert f"error: {caught.value}" == EXPECTED["backward_inplace"]
    assert isinstance(caught.value.__cause__, RuntimeError)


# a bug of oneiter raises in oneiter's own frame (a stand-in written here would be a frame of the user's)
BUG = "error: internal error: TypeError: 'NoneType' object is not callable — please report it at the oneiter issue "


def test_a_oneiter_bug_in_forward_is_still_exit_3(tmp_path, monkeypatch):
    monkeypatch.setattr("oneiter.record.capture.hooks.call_key", None)  # the capture's pre-hook, in forward
    res = run_cli("record", "--model", SPEC, "-b", "2", "-o", tmp_path / "out.h5")
    assert res.exit_code == 3 and res.stderr.strip().splitlines()[-1].startswith(BUG), res.output


@pytest.mark.parametrize("mode", ["", "backward_inplace"])
def test_a_oneiter_bug_in_backward_is_still_exit_3(tmp_path, monkeypatch, mode):
    """Also when the user's model would fail in backward too: the capture's gradient hook raises first."""
    monkeypatch.setattr("oneiter.record.capture.hooks.seq_kind", None)  # the capture's gradient hook, in backward
    res = run_cli("record", "--model", SPEC, "--model-arg", f"mode={mode}", "-b", "2", "-o", tmp_path / "out.h5")
    assert res.exit_code == 3 and res.stderr.strip().splitlines()[-1].startswith(BUG), res.output


TORCH_LINEAR = "torch/nn/modules/linear.py"


def test_a_shape_error_inside_torchs_own_module_code_is_the_users(tmp_path):
    """nn.Sequential(nn.Linear(8, 16), nn.Linear(15, 4)): the error is raised in torch's Linear.forward, under no
    line of the user's file; it is still the user's model: exit 2, one line naming the call."""
    res = run_cli("record", "--model", f"{MODEL}:build_sequential", "-b", "2", "-o", tmp_path / "out.h5")
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "internal error" not in res.output and "Traceback" not in res.output
    assert errors[0].startswith("error: the forward of 1@0 raised RuntimeError: mat1 and mat2 shapes cannot be "
                                "multiplied (2x16 and 15x4) (at "), errors[0]
    assert f"{TORCH_LINEAR}:" in errors[0] and ", in forward;" in errors[0]


@pytest.mark.parametrize("partial", [False, True])
def test_a_make_optimizer_that_raises_is_the_users(tmp_path, partial):
    res = run_cli("record", "--model", f"{MODEL}:build_bad_optimizer", "--model-arg", f"partial={partial}", "-b", "2",
                  "-o", tmp_path / "out.h5")
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "internal error" not in res.output, res.output
    assert errors[0].startswith("error: the model's make_optimizer (building the optimizer) raised TypeError: "), errors
    where = "torch/optim/" if partial else f"{MODEL}:"
    assert where in errors[0], errors[0]


def test_the_file_names_the_optimizer_that_ran(tmp_path):
    """The model's fourth item builds AdamW: the file says adamw, whatever --optimizer said (and a replay, which
    builds it the same way, loads its state)."""
    import h5py

    out, tgt = tmp_path / "out.h5", tmp_path / "tgt.h5"
    res = run_cli("record", "--model", f"{MODEL}:build_adamw", "--optimizer", "sgd", "-b", "2", "-o", out)
    assert res.exit_code == 0, res.output
    with h5py.File(out) as f:
        assert f.attrs["optimizer"] == "adamw"
    res = run_cli("record", "--model", f"{MODEL}:build_adamw", "--replay", out, "-o", tgt)
    assert res.exit_code == 0, res.output
    with h5py.File(tgt) as f:
        assert f.attrs["optimizer"] == "adamw"
