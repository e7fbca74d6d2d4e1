"""Tests for oneiter/compare (metrics, tolerance, engine, report) and the `oneiter compare` command.

Recordings are synthetic: a toy model (root -> a -> b -> c) written with `file_writer.FileWriter`, in the layout the
recorder writes, so these tests run in well under a second and need no torch.
"""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from oneiter.cli import compare_cmd
from oneiter.errors import OneIterError
from oneiter.format.file_writer import FileWriter
from oneiter.format.schema import CALLS, PARAM_GRADS, STATE_AFTER, call_key
from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.measure.metrics import compare_arrays
from oneiter.judge.measure.tolerance import DtypeTolerance, Tolerance, default_tolerance, looser
from oneiter.report.terminal import to_json

# -- a toy recording ------------------------------------------------------------------------------------------------
# (module, exec_index, seq_input, seq_output, seq_grad_output, seq_grad_input)
CALL_TABLE = [("(root)", 0, 0, 7, 0, 7), ("a", 1, 1, 2, 5, 6), ("b", 2, 3, 4, 3, 4), ("c", 3, 5, 6, 1, 2)]
PARAMS = ["a.weight", "b.weight", "c.weight", "c.bias"]


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (what torch does)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def toy_tensors(seed: int = 0) -> dict[tuple, np.ndarray]:
    """(module, phase, tensor) -> array; a@0 output is b@0 input and b@0 output is c@0 input, as in a real model."""
    rng = np.random.default_rng(seed)
    x, a, b, c = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4))
    g = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4)]
    t = {
        ("(root)", "forward", "input.0"): x, ("(root)", "forward", "output"): c,
        ("a", "forward", "input.0"): x, ("a", "forward", "output"): a,
        ("b", "forward", "input.0"): a, ("b", "forward", "output"): b,
        ("c", "forward", "input.0"): b, ("c", "forward", "output"): c,
        ("(root)", "backward", "grad_output"): g[0], ("c", "backward", "grad_output"): g[0],
        ("c", "backward", "grad_input.0"): g[1], ("b", "backward", "grad_output"): g[1],
        ("b", "backward", "grad_input.0"): g[2], ("a", "backward", "grad_output"): g[2],
        ("a", "backward", "grad_input.0"): g[3], ("(root)", "backward", "grad_input.0"): g[3],
    }
    for name in PARAMS:
        t[("param", "param_grad", name)] = rng.standard_normal(8).astype(np.float32)
        t[("param", "optimizer", name)] = rng.standard_normal(8).astype(np.float32)
    return t


def write_recording(path, tensors=None, *, meta=None, stored_dtype="float32", params=PARAMS, finish=True):
    """Write `tensors` (default: toy_tensors()) in the recorder's layout; returns the path."""
    tensors = toy_tensors() if tensors is None else tensors
    writer = FileWriter(path, {"model": "toy", "device": "cpu", "dtype": "float32", **(meta or {})})

    def put(group, name, array):
        if stored_dtype == "bfloat16" and array.dtype == np.float32:
            array = to_bf16_bits(array)
            writer.write(group, name, array, "bfloat16")
        else:
            writer.write(group, name, array, str(array.dtype))

    for module, exec_index, s_in, s_out, s_go, s_gi in CALL_TABLE:
        key = call_key(module, 0)
        writer.set_attrs(f"{CALLS}/{key}", {
            "module": module, "call": 0, "exec_index": exec_index, "class_name": "Toy",
            "seq_input": s_in, "seq_output": s_out, "seq_grad_output": s_go, "seq_grad_input": s_gi,
        })
        for (mod, phase, name), array in tensors.items():
            if mod == module:
                put(f"{CALLS}/{key}/{phase}", name, array)
    for phase, group in (("param_grad", PARAM_GRADS), ("optimizer", STATE_AFTER)):
        for name in params:
            if ("param", phase, name) in tensors:
                put(group, name, tensors[("param", phase, name)])
        writer.set_attrs(group, {"order": list(params)})
    if finish:
        writer.finish({})
    else:
        writer.abort()
    return path


def perturbed(key, delta=1e-2, seed=0):
    tensors = toy_tensors(seed)
    tensors[key] = tensors[key] + np.float32(delta)
    return tensors


@pytest.fixture
def ref(tmp_path):
    return write_recording(tmp_path / "ref.h5")


def run(*args):
    app = typer.Typer()
    compare_cmd.register(app)
    app.command("noop", hidden=True)(lambda: None)  # two commands: `compare` stays a named subcommand
    return CliRunner().invoke(app, ["compare", *map(str, args)])


# -- metrics --------------------------------------------------------------------------------------------------------
def test_metrics_hand_computed():
    a, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 3.0, 4.5])
    m = compare_arrays(a, b, atol=0.1, rtol=0.0)
    assert m.max_abs == pytest.approx(0.5)
    assert m.rel_l2 == pytest.approx(0.5 / math.sqrt(30))
    assert m.cosine == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)))
    assert m.max_rel == pytest.approx(0.5 / 4.5)
    assert (m.num_out, m.frac_out) == (1, 0.25)
    assert m.need_atol == pytest.approx(0.5)  # rtol 0: atol must cover the whole error
    assert m.need_rtol == pytest.approx((0.5 - 0.1) / 4.0)
    m = compare_arrays(a, b, atol=0.0, rtol=0.1)
    assert m.need_atol == pytest.approx(0.1) and m.need_rtol == pytest.approx(0.125)


def test_max_rel_stays_bounded_near_zero():
    a, b = np.array([1.0, 1e-9, 0.0]), np.array([1.0, 2e-9, 1e-12])
    m = compare_arrays(a, b, atol=1e-5, rtol=1e-3)
    assert m.max_rel == pytest.approx(1e-9 / 1e-3)  # floor = 1e-3 * max|a|
    assert not m.diverged
    assert compare_arrays(np.array([0.0, 0.0]), np.array([0.0, 1.0]), atol=0, rtol=0).max_rel == pytest.approx(1.0)


def test_metrics_zero_tensors_and_exact_match():
    zeros = np.zeros(5, np.float32)
    m = compare_arrays(zeros, zeros, atol=0, rtol=0)
    assert (m.rel_l2, m.cosine, m.max_abs, m.diverged) == (0.0, 1.0, 0.0, False)
    m = compare_arrays(zeros, np.ones(5, np.float32), atol=0, rtol=0)
    assert m.rel_l2 == math.inf and m.cosine == 0.0 and m.need_rtol == math.inf
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    m = compare_arrays(x, x.copy(), atol=0, rtol=0)
    assert (m.max_abs, m.rel_l2, m.cosine, m.num_out) == (0.0, 0.0, 1.0, 0)


def test_metrics_nan_inf_counts():
    a = np.array([np.nan, 1.0, np.inf, 2.0], np.float32)
    b = np.array([np.nan, 1.0, 1.0, 2.0], np.float32)
    m = compare_arrays(a, b, atol=1e-5, rtol=1e-5)
    assert (m.num_nan_ref, m.num_inf_ref, m.num_nan_target, m.num_inf_target) == (1, 1, 1, 0)
    assert m.num_out == 1 and m.diverged and m.max_abs == 0.0  # value metrics only see finite pairs
    same = compare_arrays(a, a.copy(), atol=0, rtol=0)
    assert not same.diverged and same.num_nan_ref == 1 and same.num_inf_target == 1
    flipped = compare_arrays(np.array([np.inf]), np.array([-np.inf]), atol=0, rtol=0)
    assert flipped.diverged and flipped.num_out == 1


def test_metrics_chunking_gives_the_same_numbers():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(1000)
    b = a + rng.standard_normal(1000) * 1e-4
    whole, chunked = compare_arrays(a, b, atol=1e-5, rtol=1e-4), compare_arrays(a, b, atol=1e-5, rtol=1e-4, chunk=7)
    for name in ("max_abs", "max_rel", "rel_l2", "cosine", "need_atol", "need_rtol"):
        assert getattr(chunked, name) == pytest.approx(getattr(whole, name), rel=1e-12)
    assert chunked.num_out == whole.num_out


# -- tolerance ------------------------------------------------------------------------------------------------------
def test_tolerance_defaults_and_overrides():
    assert tuple(default_tolerance("float32")) == (1e-5, 1.3e-6)
    assert tuple(default_tolerance("bfloat16")) == (1e-5, 1.6e-2)
    assert tuple(default_tolerance("float16")) == (1e-5, 1e-3)
    assert tuple(default_tolerance("float64")) == (1e-7, 1e-7)
    assert tuple(default_tolerance("int64")) == (0.0, 0.0)
    policy = DtypeTolerance(rtol=1e-2)
    atol, rtol = policy(None, "float32")
    assert (atol, rtol) == (1e-5, 1e-2)
    assert looser(default_tolerance("float32"), default_tolerance("bfloat16")).rtol == 1.6e-2
    with pytest.raises(OneIterError, match="tolerances must be >= 0"):
        Tolerance(-1.0, 0.0)


# -- engine and CLI -------------------------------------------------------------------------------------------------
def test_identical_files_match(ref, tmp_path):
    tgt = write_recording(tmp_path / "tgt.h5")
    result = compare_files(ref, tgt)
    assert result.status == "match" and all(r.metrics.max_abs == 0 for r in result.rows)
    assert len(result.rows) == 16 + 2 * len(PARAMS)
    res = run(ref, tgt, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("MATCH")
    data = json.loads((tmp_path / "r.json").read_text())
    verdict = data["verdict"]
    assert verdict["status"] == "match" and verdict["num_entries"] == len(result.rows)
    assert verdict["culprit"] is None and verdict["nan_origin"] is None and verdict["first_divergence"] is None
    assert verdict["basis"] == "first_divergence"  # synthetic files carry no local data
    assert all(row["max_abs"] == 0 for row in data["rows"])


def test_forward_perturbation_is_named(ref, tmp_path):
    tgt = write_recording(tmp_path / "tgt.h5", perturbed(("b", "forward", "output")))
    res = run(ref, tgt, "--json", tmp_path / "r.json", "--csv", tmp_path / "r.csv")
    assert res.exit_code == 1, res.output
    first = res.stdout.splitlines()[0]
    assert first.startswith("DIVERGED at b@0 forward output") and "max_abs 1.00e-02" in first
    verdict = json.loads((tmp_path / "r.json").read_text())["verdict"]
    assert {k: verdict[k] for k in ("status", "module", "call", "phase", "tensor")} == {
        "status": "diverged", "module": "b", "call": 0, "phase": "forward", "tensor": "output"}
    assert verdict["max_abs"] == pytest.approx(1e-2, rel=1e-4) and verdict["cosine"] < 1
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].startswith("index,module,call,phase,tensor,status") and len(lines) == 1 + 16 + 2 * len(PARAMS)


def test_backward_divergence_in_causal_order(ref, tmp_path):
    tensors = perturbed(("a", "backward", "grad_input.0"))
    tensors[("c", "backward", "grad_input.0")] = tensors[("c", "backward", "grad_input.0")] * 1.5
    tgt = write_recording(tmp_path / "tgt.h5", tensors)
    result = compare_files(ref, tgt)
    row = result.divergence
    assert (row.module, row.phase, row.tensor) == ("c", "backward", "grad_input.0")  # c's gradient comes first
    assert all(not r.diverged for r in result.rows if r.phase == "forward")
    assert run(ref, tgt).exit_code == 1


@pytest.mark.parametrize("phase", ["param_grad", "optimizer"])
def test_parameter_phases(ref, tmp_path, phase):
    tgt = write_recording(tmp_path / "tgt.h5", perturbed(("param", phase, "b.weight")))
    row = compare_files(ref, tgt).divergence
    assert (row.module, row.call, row.phase, row.tensor) == ("b", 0, phase, "weight")


def test_missing_entries_are_never_a_pass(ref, tmp_path):
    tensors = toy_tensors()
    del tensors[("a", "forward", "output")]
    tgt = write_recording(tmp_path / "tgt.h5", tensors)
    result = compare_files(ref, tgt)
    assert result.divergence.status == "missing_in_target" and result.divergence.name == "a@0 forward output"
    reverse = compare_files(tgt, ref)
    assert reverse.divergence.status == "missing_in_reference"
    assert reverse.divergence.name == "a@0 forward output"  # placed where it happened, not at the end
    assert run(ref, tgt).exit_code == 1


def test_shape_and_dtype_mismatch(ref, tmp_path):
    tensors = toy_tensors()
    tensors[("b", "forward", "output")] = tensors[("b", "forward", "output")][:2]
    result = compare_files(ref, write_recording(tmp_path / "shape.h5", tensors))
    assert result.divergence.status == "shape_mismatch" and "(4, 8) vs (2, 8)" in result.divergence.reason
    tensors = toy_tensors()
    tensors[("a", "forward", "output")] = tensors[("a", "forward", "output")].astype(np.float64)
    result = compare_files(ref, write_recording(tmp_path / "dtype.h5", tensors))
    assert result.divergence.status == "dtype_mismatch" and result.divergence.name == "a@0 forward output"


def test_runs_in_different_dtypes_use_the_lower_precision(ref, tmp_path):
    tgt = write_recording(tmp_path / "bf16.h5", meta={"dtype": "bfloat16"}, stored_dtype="bfloat16")
    result = compare_files(ref, tgt)
    assert result.status == "match", result.divergence
    row = result.rows[0]
    assert (row.dtype, row.dtype_target, row.tolerance.rtol) == ("float32", "bfloat16", 1.6e-2)
    assert row.metrics.max_abs > 0  # bf16 rounding is there, within bf16 tolerance


def test_bfloat16_recordings_are_decoded(tmp_path):
    meta = {"dtype": "bfloat16"}
    ref = write_recording(tmp_path / "a.h5", meta=meta, stored_dtype="bfloat16")
    assert compare_files(ref, write_recording(tmp_path / "b.h5", meta=meta, stored_dtype="bfloat16")).status == "match"
    tgt = write_recording(tmp_path / "c.h5", perturbed(("b", "forward", "output"), 0.5), meta=meta,
                          stored_dtype="bfloat16")
    row = compare_files(ref, tgt).divergence
    assert row.name == "b@0 forward output" and row.dtype == "bfloat16"
    assert 0.4 < row.metrics.max_abs < 0.6  # decoded values, not raw uint16 bits


def test_nan_in_target_diverges(ref, tmp_path):
    tensors = toy_tensors()
    tensors[("c", "forward", "output")] = tensors[("c", "forward", "output")].copy()
    tensors[("c", "forward", "output")][0, 0] = np.nan
    result = compare_files(ref, write_recording(tmp_path / "nan.h5", tensors))
    assert result.divergence.name == "c@0 forward output" and result.divergence.metrics.num_nan_target == 1
    assert "NaN 0 vs 1" in result.divergence.reason


def test_tolerance_override_turns_divergence_into_match(ref, tmp_path):
    tgt = write_recording(tmp_path / "tgt.h5", perturbed(("b", "forward", "output"), 1e-3))
    assert run(ref, tgt).exit_code == 1
    assert run(ref, tgt, "--atol", "2e-3").exit_code == 0


def test_terminal_shows_rows_around_divergence(ref, tmp_path):
    tgt = write_recording(tmp_path / "tgt.h5", perturbed(("(root)", "forward", "input.0")))
    res = run(ref, tgt)
    assert res.exit_code == 1 and "more not shown (--all)" in res.stdout
    assert "state_after" not in res.stdout and res.stdout.count("optimizer") == 0
    full = run(ref, tgt, "--all")
    assert full.stdout.count("optimizer") == len(PARAMS)


def test_json_to_stdout_is_parseable(ref, tmp_path):
    res = run(ref, write_recording(tmp_path / "tgt.h5", perturbed(("a", "forward", "output"))), "--json", "-")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["verdict"]["module"] == "a" and data["meta"]["reference"]["model"] == "toy"
    assert "DIVERGED" in res.stderr


def test_report_json_has_no_bare_infinity(tmp_path):
    tensors = toy_tensors()
    tensors[("a", "forward", "output")] = np.zeros((4, 8), np.float32)
    ref = write_recording(tmp_path / "ref.h5", tensors)
    text = json.dumps(to_json(compare_files(ref, write_recording(tmp_path / "tgt.h5"))), allow_nan=False)
    assert '"rel_l2": "inf"' in text


# -- bad input: one line, exit 2 ------------------------------------------------------------------------------------
def assert_bad_input(res):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    message = res.stderr.strip()
    assert message.startswith("error:") and len(message.splitlines()) == 1, message
    return message


def test_missing_file(ref, tmp_path):
    assert "does not exist" in assert_bad_input(run(ref, tmp_path / "nope.h5"))


def test_not_hdf5(ref, tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("hello")
    assert "not an HDF5 file" in assert_bad_input(run(path, ref))


def test_foreign_hdf5(ref, tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    assert "not a oneiter recording" in assert_bad_input(run(ref, path))


def test_truncated_file(ref, tmp_path):
    path = tmp_path / "cut.h5"
    data = ref.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_bad_input(run(ref, path))


def test_incomplete_file(ref, tmp_path):
    path = write_recording(tmp_path / "partial.h5", finish=False)
    assert "incomplete" in assert_bad_input(run(ref, path))


def test_different_models(ref, tmp_path):
    other = write_recording(tmp_path / "other.h5", meta={"model": "resnet18"})
    assert "resnet18" in assert_bad_input(run(ref, other))


def test_different_parameter_names(ref, tmp_path):
    other = write_recording(tmp_path / "other.h5", params=PARAMS + ["d.weight"])
    assert "different parameters" in assert_bad_input(run(ref, other))


def test_outputs_never_overwrite_inputs(ref, tmp_path):
    tgt = write_recording(tmp_path / "tgt.h5")
    before = tgt.read_bytes()
    assert "overwrite" in assert_bad_input(run(ref, tgt, "--json", tgt))
    assert "overwrite" in assert_bad_input(run(ref, tgt, "--csv", ref))
    assert tgt.read_bytes() == before


def test_help_shows_an_example():
    res = run("--help")
    assert res.exit_code == 0 and "oneiter compare cpu.h5" in res.stdout


def test_rounding_size_divergence_gets_a_hint(ref, tmp_path):
    tensors = toy_tensors()
    out = tensors[("b", "forward", "output")]
    tensors[("b", "forward", "output")] = out + np.float32(2e-5) * np.sign(out)  # elementwise out, rel_l2 ~2e-5
    tgt = write_recording(tmp_path / "tgt.h5", tensors, meta={"num_threads": 1})
    res = run(ref, tgt, "--rtol", "1e-5", "--atol", "0")
    assert res.exit_code == 1 and res.stdout.splitlines()[1].startswith("hint:")
    big = run(ref, write_recording(tmp_path / "big.h5", perturbed(("b", "forward", "output"), 0.5)))
    assert "hint:" not in big.stdout
