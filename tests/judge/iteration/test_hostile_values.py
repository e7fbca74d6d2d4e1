"""Judging values a target should never get away with: integers off by one, NaN/Inf moved or flipped, a replay
that did not start from the reference, a loss that differs, stored noise that would excuse anything, and values
tampered far beyond what their inputs explain while the local rows say all is well."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from conftest import record_small, replay, run_cli

import oneiter
from oneiter.judge.measure.metrics import compare_arrays


def test_integers_are_compared_exactly_not_through_float64():
    a = np.array([2**60, 7, -3], dtype=np.int64)
    b = a.copy()
    b[0] += 1  # the same float64
    m = compare_arrays(a, b, atol=0.0, rtol=0.0)
    assert (m.num_out, m.diverged) == (1, True)
    assert not compare_arrays(a, a.copy(), atol=0.0, rtol=0.0).diverged
    assert compare_arrays(np.array([True, False]), np.array([True, True]), atol=0.0, rtol=0.0).num_out == 1


@pytest.mark.parametrize("target", [
    [1.0, 2.0, np.nan, 4.0],        # the NaN moved
    [1.0, np.nan, 3.0, -np.inf],    # +inf became -inf in place
])
def test_nan_and_inf_are_judged_by_position_and_sign(target):
    ref = np.array([1.0, np.nan, 3.0, np.inf], dtype=np.float32)
    m = compare_arrays(ref, np.array(target, dtype=np.float32), atol=1e-5, rtol=1e-6)
    assert m.diverged and m.num_out >= 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory, references):
    """A llama_tiny reference (a copy of the shared one), a replay with local data and one without."""
    d = tmp_path_factory.mktemp("hostile")
    shutil.copy(references("llama_tiny"), d / "ref.h5")
    replay(d / "ref.h5", d / "tgt.h5")
    replay(d / "ref.h5", d / "plain.h5", isolate=False)
    return d


def _mutate(src, dst, edit):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


def _first(f, group):
    name = next(iter(f[group]))
    return f"{group}/{name}"


def test_a_clean_replay_matches_and_is_no_bad_replay(pair):
    for target in ("tgt.h5", "plain.h5"):
        result = oneiter.compare(pair / "ref.h5", pair / target)
        assert result.status == "match" and result.notes == []


@pytest.mark.parametrize("group", ["state_before", "batch"])
def test_a_replay_that_did_not_start_from_the_reference_is_a_bad_replay(pair, tmp_path, group):
    def edit(f):
        path = _first(f, group)
        data = f[path][()]
        data.reshape(-1)[0] = data.reshape(-1)[0] + 1
        f[path][...] = data

    bad = _mutate(pair / "tgt.h5", tmp_path / "bad.h5", edit)
    res = run_cli("compare", pair / "ref.h5", bad)
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bad replay: the target's " + group)


def test_another_optimizer_is_a_bad_replay(pair, tmp_path):
    bad = _mutate(pair / "plain.h5", tmp_path / "adamw.h5", lambda f: f.attrs.__setitem__("optimizer", "adamw"))
    res = run_cli("compare", pair / "ref.h5", bad)
    assert res.exit_code == 2 and "the reference ran optimizer 'sgd', the target 'adamw'" in res.stderr


def test_a_target_that_is_no_replay_is_said_before_any_row(pair, tmp_path):
    record_small(tmp_path / "again.h5", "llama_tiny")  # the same model and seed, recorded again: equal, no note
    res = run_cli("compare", pair / "ref.h5", tmp_path / "again.h5")
    assert res.exit_code == 0 and res.stderr == ""
    record_small(tmp_path / "other.h5", "llama_tiny", seed=1)  # other weights and batch: why everything differs
    res = run_cli("compare", pair / "ref.h5", tmp_path / "other.h5")
    assert res.exit_code == 1
    assert res.stderr.startswith("warning: ") and "is not a replay (recorded without --replay)" in res.stderr
    assert res.stdout.index("DIVERGED") < res.stdout.index("entries")


def test_the_loss_is_judged_without_local_data(pair, tmp_path):
    bad = _mutate(pair / "plain.h5", tmp_path / "loss.h5", lambda f: f["loss"].__setitem__((), f["loss"][()] * 1.01))
    result = oneiter.compare(pair / "ref.h5", bad)
    verdict = result.verdict()
    assert result.status == "diverged" and verdict["focus"] == "loss"
    assert verdict["headline"].startswith("DIVERGED at the loss")


def _scale(path_of, factor):
    def edit(f):
        path = path_of(f)
        f[path][...] = f[path][()] * factor
    return edit


def _root_output(f):
    return "calls/(root)@0/forward/output"


def _a_param(group):
    return lambda f: _first(f, group)


@pytest.mark.parametrize("what, edit", [
    ("forward output x1000", _scale(lambda f: "calls/layers.0.attention.wq@0/forward/output", 1000.0)),
    ("param grads negated", _scale(_a_param("param_grads"), -1.0)),
    ("updated parameters x100", _scale(_a_param("state_after"), 100.0)),
])
def test_values_far_beyond_their_inputs_never_match_even_with_clean_local_rows(pair, tmp_path, what, edit):
    bad = _mutate(pair / "tgt.h5", tmp_path / "bad.h5", edit)
    result = oneiter.compare(pair / "ref.h5", bad)
    assert result.status == "diverged", what
    assert result.exit_code == 1


@pytest.mark.parametrize("value", [np.nan, np.inf, -1.0])
def test_stored_noise_never_excuses_a_local_error(pair, tmp_path, value):
    """Every local row claims a large error and a useless noise: NaN (not calibrated) falls back to the floor,
    inf is no measurement: the run must diverge; a negative noise is out of range: the file is refused."""
    def edit(f):
        table = f["local"][()]
        table["rel_l2"] = 0.5
        table["max_abs"] = 0.5
        table["noise_target"] = value
        table["noise_reference"] = value
        f["local"][...] = table

    bad = _mutate(pair / "tgt.h5", tmp_path / "noise.h5", edit)
    if value < 0:
        res = run_cli("compare", pair / "ref.h5", bad)
        assert res.exit_code == 2 and "noise_target -1.0, expected >= 0 (or NaN)" in res.stderr
        return
    result = oneiter.compare(pair / "ref.h5", bad)
    assert result.status == "diverged" and result.culprit is not None


def test_local_data_that_was_deleted_is_damage_not_a_skip(pair, tmp_path):
    bad = _mutate(pair / "tgt.h5", tmp_path / "nolocal.h5", lambda f: f.__delitem__("local"))
    res = run_cli("compare", pair / "ref.h5", bad)
    assert res.exit_code == 2 and "its /local table is missing: the file is damaged" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
