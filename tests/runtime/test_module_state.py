"""Tensors a module keeps in plain attributes between calls (runtime/module_state.py): a rerun starts from them as the
live call found them and leaves them as the live call left them. Hugging Face's RecurrentGemma RG-LRU keeps its final
recurrent state as `self.recurrent_states`; a rerun that started from what the live call left there backpropagated
into the live graph, and the replay's own backward failed ("Trying to backward through the graph a second time")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import torch
import torch.nn as nn
from conftest import MODEL_FILES, record_small

from oneiter.runtime import module_state

SPEC = f"{MODEL_FILES / 'stateful.py'}:build"


def _oneiter(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1"}
    return subprocess.run([sys.executable, "-m", "oneiter", *map(str, args)], env=env, capture_output=True,
                          text=True, check=False)


def test_a_module_keeping_its_graph_state_as_an_attribute_replays_clean(tmp_path):
    """tests/model_files/stateful.py (the RG-LRU's shape): the replay exits 0, every call is probed, and the compare
    is a MATCH on every call's local error."""
    ref, tgt, report = tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path / "report.json"
    record_small(ref, SPEC)
    res = _oneiter("record", "--model", SPEC, "--replay", ref, "-o", tgt)
    assert res.returncode == 0, res.stderr
    with h5py.File(tgt) as f:
        assert f["local"].attrs["num_unprobed"] == 0
        assert f["local"].attrs["num_calls"] == 7
    res = _oneiter("compare", ref, tgt, "--json", report)
    verdict = json.loads(report.read_text())["verdict"]
    assert res.returncode == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict


def test_started_puts_the_attributes_back_as_the_call_found_them():
    outer = nn.Sequential(nn.Linear(2, 2))
    inner = outer[0]
    start = torch.ones(3, requires_grad=True) * 2  # a tensor of a graph, as a forward leaves one
    inner.state, inner.config = start, "kept"
    saved = module_state.state(outer)  # as a call begins
    end = start * 3  # what the live call leaves
    inner.state, inner.made = end, end.sum()
    with module_state.started(saved):
        assert torch.equal(inner.state, torch.full((3,), 2.0))
        assert inner.state.grad_fn is None and inner.state.data_ptr() != start.data_ptr()  # a copy, out of the graph
        assert not hasattr(inner, "made")  # the call made it: not there when it began
        inner.state, inner.cache = torch.zeros(3), torch.zeros(3)  # what the rerun leaves
    assert inner.state is end and inner.made.grad_fn is not None and inner.config == "kept"
    assert not hasattr(inner, "cache")


def test_without_a_saved_state_nothing_changes():
    module = nn.Linear(2, 2)
    module.state = torch.ones(2)
    with module_state.started(None):
        assert torch.equal(module.state, torch.ones(2))


TWICE = f"{MODEL_FILES / 'stateful.py'}:build_twice"


def _twice(tmp_path, monkeypatch, fault: str = "", **options):
    from conftest import replay, replay_with_fault

    from oneiter.judge.iteration.engine import compare_files

    ref, tgt = tmp_path / "twice_ref.h5", tmp_path / "twice.h5"
    if not ref.exists():
        record_small(ref, TWICE, threads=1)
    if fault:
        replay_with_fault(ref, tgt, fault, monkeypatch, threads=1, force=True, **options)
    else:
        replay(ref, tgt, threads=1, force=True, **options)
    return compare_files(ref, tgt).verdict_obj


def test_state_carried_between_two_calls_of_one_iteration_replays_clean(tmp_path, monkeypatch):
    """The scan called twice, its second call starting from the state its first left: the first call's rerun alone
    cannot seed the gradient that reaches it through the attribute (was `block.scan@0 backward grad_input.0`, 4.9
    million times its noise, on an exact replay). Neither is probed alone: both are listed, with the attribute."""
    for options in ({}, {"amp": "bf16"}):
        verdict = _twice(tmp_path, monkeypatch, **options)
        assert verdict.status == "match" and verdict.basis == "local_error", verdict.headline
        assert [(u["module"], u["call"]) for u in verdict.unprobed] == [("block.scan", 0), ("block.scan", 1)]
        assert all("block.scan@1 starts from the tensor block.scan@0 left in block.scan.state" in u["reason"]
                   for u in verdict.unprobed)


def test_a_fault_in_calls_carrying_state_is_named_at_their_caller(tmp_path, monkeypatch):
    """Backward: both calls run live in their caller's rerun, which is named, including them; forward: the first
    call's own forward rows stand."""
    verdict = _twice(tmp_path, monkeypatch, "instance_bwd:block.scan")
    assert (verdict.culprit.module, verdict.culprit.phase) == ("block", "backward") and verdict.culprit.ratio > 4
    assert [(u["module"], u["call"]) for u in verdict.culprit_includes] == [("block.scan", 0), ("block.scan", 1)]
    verdict = _twice(tmp_path, monkeypatch, "instance:block.scan")
    assert (verdict.culprit.module, verdict.culprit.call, verdict.culprit.phase) == ("block.scan", 0, "forward")
