"""Tests for oneiter/format/inspection.py and the `oneiter inspect` command, on a small synthetic recording."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from oneiter.cli import inspect_cmd
from oneiter.format.file_writer import FileWriter
from oneiter.format.inspection import summarize_file, tensor_stats
from oneiter.format.schema import BATCH, CALLS, LOSS, PARAM_GRADS, STATE_AFTER, STATE_BEFORE, call_key


def bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.fixture
def recording(tmp_path):
    """One Linear layer `fc` inside the model: batch, loss, forward/backward of both calls, params, state."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 4)).astype(np.float32)
    y[0, 0] = np.nan
    w = FileWriter(tmp_path / "rec.h5", {"model": "toy", "device": "cpu", "dtype": "float32", "seed": 0})
    w.write(BATCH, "input.0", x, "float32")
    w.write("/", LOSS, np.array(1.5, np.float32), "float32")
    for module, exec_index in (("(root)", 0), ("fc", 1)):
        key = call_key(module, 0)
        w.set_attrs(f"{CALLS}/{key}", {"module": module, "call": 0, "exec_index": exec_index, "class_name": "Linear",
                                       "seq_input": exec_index, "seq_output": 3 - exec_index,
                                       "seq_grad_output": exec_index, "seq_grad_input": 3 - exec_index})
        w.write(f"{CALLS}/{key}/forward", "input.0", x, "float32")
        w.write(f"{CALLS}/{key}/forward", "output", y, "float32")
        w.write(f"{CALLS}/{key}/backward", "grad_output", bf16_bits(np.full((2, 4), 1.5, np.float32)), "bfloat16")
    for group in (STATE_BEFORE, PARAM_GRADS, STATE_AFTER):
        w.write(group, "fc.weight", np.arange(12, dtype=np.float32).reshape(4, 3), "float32")
        w.write(group, "fc.bias", np.zeros(4, np.float32), "float32")
        w.set_attrs(group, {"order": ["fc.weight", "fc.bias"]})
    w.finish({})
    return tmp_path / "rec.h5"


def run(*args):
    app = typer.Typer()
    inspect_cmd.register(app)
    app.command("noop", hidden=True)(lambda: None)
    return CliRunner().invoke(app, ["inspect", *map(str, args)])


def test_tensor_stats_skip_non_finite():
    stats = tensor_stats(np.array([1.0, 2.0, 3.0, np.nan, np.inf, -np.inf]))
    assert stats == {"min": 1.0, "max": 3.0, "mean": 2.0, "std": pytest.approx(np.std([1.0, 2.0, 3.0])),
                     "num_nan": 1, "num_inf": 2}
    assert tensor_stats(np.array([np.nan]))["mean"] is None


def test_tensor_stats_chunked_std_is_exact_with_a_large_mean():
    x = 1e6 + np.random.default_rng(0).standard_normal(1000)
    assert tensor_stats(x, chunk=7)["std"] == pytest.approx(np.std(x), rel=1e-9)


def test_summary_lists_everything(recording):
    summary = summarize_file(recording)
    names = [t.name for t in summary.tensors]
    assert names[:2] == ["(root)@0 batch input.0", "(root)@0 loss loss"]
    assert "fc@0 forward output" in names and "fc@0 backward grad_output" in names
    assert "fc@0 param_grad weight" in names and "fc@0 optimizer bias" in names and "fc@0 state_before weight" in names
    grad = next(t for t in summary.tensors if t.name == "fc@0 backward grad_output")
    assert grad.dtype == "bfloat16" and grad.mean == 1.5  # decoded, not raw bits
    out = next(t for t in summary.tensors if t.name == "fc@0 forward output")
    assert out.num_nan == 1 and out.shape == (2, 4)


def test_inspect_table(recording):
    res = run(recording)
    assert res.exit_code == 0, res.output
    assert any(line.split() == ["model", "toy"] for line in res.stdout.splitlines()) and "2 module calls" in res.stdout
    for text in ("fc@0", "grad_output", "bfloat16", "2x4", "param_grad", "optimizer"):
        assert text in res.stdout


def test_inspect_json(recording):
    res = run(recording, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["meta"]["model"] == "toy" and data["num_calls"] == 2
    weight = next(t for t in data["tensors"] if t["phase"] == "param_grad" and t["tensor"] == "weight")
    assert (weight["min"], weight["max"], weight["mean"], weight["shape"]) == (0.0, 11.0, 5.5, [4, 3])


@pytest.mark.parametrize("kind", ["missing", "text", "foreign", "truncated"])
def test_inspect_bad_input(recording, tmp_path, kind):
    path = tmp_path / f"{kind}.h5"
    if kind == "text":
        path.write_text("not hdf5")
    elif kind == "foreign":
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros(2)
    elif kind == "truncated":
        data = recording.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    res = run(path)
    assert res.exit_code == 2 and "Traceback" not in res.output
    message = res.stderr.strip()
    assert message.startswith("error:") and len(message.splitlines()) == 1, message
