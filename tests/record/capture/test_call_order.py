"""A replay numbers each module's calls as its reference did where its own run calls them in another order
(`ModuleCapture.pair_with`): a call gets the index of the reference's call with the same non-tensor arguments.
The model (tests/model_files/hash_order.py, ModernBERT's shape) calls `rope` once per attention kind, in the order
of a Python set of strings, which two processes with other hash seeds iterate differently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import MODEL_FILES, record_small, replay

from oneiter.api import compare

SPEC = f"{MODEL_FILES / 'hash_order.py'}:build"
# two hash seeds that order {"full_attention", "sliding_attention"} differently (checked below)
SEEDS = ("0", "1")


def _oneiter(*args, seed: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": seed, "ONEITER_NO_PROGRESS": "1"}
    return subprocess.run([sys.executable, "-m", "oneiter", *map(str, args)], env=env, capture_output=True,
                          text=True, check=False)


def _order(seed: str) -> list[str]:
    code = "import json; print(json.dumps(list({'full_attention', 'sliding_attention'})))"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    return json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout)


@pytest.mark.slow  # five processes: the record, the replay and the compare each in a fresh interpreter
def test_calls_run_in_another_order_are_paired_by_their_arguments(tmp_path):
    assert _order(SEEDS[0]) != _order(SEEDS[1])  # the premise: the two processes call rope in other orders
    ref, tgt, report = tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path / "report.json"
    assert _oneiter("record", "--model", SPEC, "-b", "2", "-o", ref, seed=SEEDS[0]).returncode == 0
    res = _oneiter("record", "--model", SPEC, "--replay", ref, "-o", tgt, seed=SEEDS[1])
    assert res.returncode == 0, res.stderr
    with h5py.File(ref) as a, h5py.File(tgt) as b:
        for call in ("rope@0", "rope@1"):
            assert a[f"calls/{call}"].attrs["arg.input.1"] == b[f"calls/{call}"].attrs["arg.input.1"]
        # the target ran them in its own order: its first rope call is the reference's second
        first = min(("rope@0", "rope@1"), key=lambda c: b[f"calls/{c}"].attrs["exec_index"])
        assert first == "rope@1"
    res = _oneiter("compare", ref, tgt, "--json", report, seed=SEEDS[1])
    verdict = json.loads(report.read_text())["verdict"]
    assert res.returncode == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict


def test_numpy_and_python_random_in_forward_draw_what_the_reference_drew(tmp_path):
    """A model masking what numpy.random and Python's random choose in forward (Wav2Vec2's SpecAugment): the
    recording seeds both with torch's seed, so the replay (in this same process, the generators moved on since)
    draws the reference's masks, and each call's rerun starts them where the live call began (runtime/host_random.py):
    a clean replay is a MATCH, on every call's local error."""
    spec = f"{MODEL_FILES / 'numpy_mask.py'}:build"
    ref, tgt = tmp_path / "ref.h5", tmp_path / "tgt.h5"
    record_small(ref, spec, seed=0)
    np.random.seed(12345)  # where the generators are left has no say in what a replay draws
    replay(ref, tgt)
    result = compare(ref, tgt)
    verdict = result.verdict_obj
    assert verdict.status == "match" and verdict.basis == "local_error", verdict.headline
