"""A value each block both consumes and returns to the next: no false alarm, and a fault behind it still named.

T5 computes `position_bias` in its first block, returns it, and passes it into every later block, which consumes
it and returns the same tensor; `model_files/handoff.py` has that shape in plain torch. The gradient recorded for
such an output is the tensor's whole gradient (every block's consumption), while a block's `grad_input` for it
holds only its own consumers' part. The probes' reruns once seeded the pass-through output with that whole, which
flowed straight back into `grad_input`: every clean replay was DIVERGED at the second block with a ratio ~1e7,
and that false alarm hid any real fault later in causal order (the first block's backward, parameter gradients).
"""

from __future__ import annotations

import pytest
from conftest import MODEL_FILES, compare_verdict, replay, replay_with_fault, run_cli

from oneiter.judge.iteration.engine import compare_files

HANDOFF = str(MODEL_FILES / "handoff.py:build")
T5 = str(MODEL_FILES / "hf_t5.py:build")


def _t5(*options):
    return [pytest.param(T5, o, marks=pytest.mark.slow, id=f"t5-{'-'.join(map(str, o.values()))}") for o in options]


CLEAN = [pytest.param(HANDOFF, o, id=f"handoff-{'-'.join(map(str, o.values()))}")
         for o in ({"seed": 3}, {"threads": 1}, {"amp": "bf16"})]
CLEAN += _t5({"seed": 3}, {"threads": 1}, {"amp": "bf16"})


@pytest.mark.parametrize("spec,options", CLEAN)
def test_clean_replays_are_a_match(spec, options, references, tmp_path):
    ref, tgt = references(spec), tmp_path / "tgt.h5"
    replay(ref, tgt, **options)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict
    assert verdict["unprobed"] == [] and verdict["num_local"] > 20


def test_the_handed_on_gradient_is_still_judged_and_exact(references, tmp_path):
    """The later blocks' own consumption of the bias is a judged row (not dropped as passed on), and on an exact
    replay it is bit for bit the reference's."""
    ref, tgt = references(HANDOFF), tmp_path / "tgt.h5"
    replay(ref, tgt)
    rows = {(r.module, r.tensor): r for r in compare_files(ref, tgt).local if r.phase == "backward"}
    for block in ("blocks.1", "blocks.2"):
        row = rows[(block, "grad_input.1")]
        assert row.metrics.rel_l2 == 0.0 and not row.flagged


# (model, fault, replay options, expected culprit: module, call, phase, tensor; every flagged row's module)
FAULTED = [
    # only the first block makes the bias (softplus, in its own code): its backward runs after every later block's
    (HANDOFF, "function_bwd:softplus", {}, ("blocks.0", 0, "backward", "blocks.0.bias@0:grad_output"),
     {"blocks.0"}),
    (HANDOFF, "function_bwd:softplus:0.03", {"amp": "bf16"},
     ("blocks.0", 0, "backward", "blocks.0.bias@0:grad_output"), {"blocks.0"}),
    (HANDOFF, "instance:blocks.2.out", {}, ("blocks.2.out", 0, "forward", "output"), {"blocks.2.out"}),
    (HANDOFF, "function_bwd:gelu", {}, ("blocks.2.act", 0, "backward", "grad_input.0"),
     {"blocks.0.act", "blocks.1.act", "blocks.2.act"}),
]
FAULTED = [pytest.param(*case, id=f"handoff-{case[1]}-{'-'.join(map(str, case[2].values())) or 'fp32'}")
           for case in FAULTED]
FAULTED += [
    pytest.param(T5, "instance:t5.decoder.block.1.layer.2.DenseReluDense.wo", {},
                 ("t5.decoder.block.1.layer.2.DenseReluDense.wo", 0, "forward", "output"),
                 {"t5.decoder.block.1.layer.2.DenseReluDense.wo"}, marks=pytest.mark.slow, id="t5-instance-wo"),
    # every embedding's weight gradient is off (parameter gradients come after all of backward, where the false
    # alarm used to be): the shared token embedding and both first blocks' relative attention bias
    pytest.param(T5, "function_bwd:embedding", {}, ("t5.shared", 0, "param_grad", "weight"),
                 {"t5.shared", "t5.encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
                  "t5.decoder.block.0.layer.0.SelfAttention.relative_attention_bias"},
                 marks=pytest.mark.slow, id="t5-function_bwd-embedding"),
]


@pytest.mark.parametrize("spec,fault,options,expected,flagged", FAULTED)
def test_a_fault_behind_the_handed_on_value_is_named(spec, fault, options, expected, flagged, references, tmp_path,
                                                     monkeypatch):
    ref, tgt = references(spec), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, fault, monkeypatch, **options)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    culprit = verdict["culprit"]
    assert code == 1 and verdict["status"] == "diverged" and verdict["basis"] == "local_error", verdict
    assert (culprit["module"], culprit["call"], culprit["phase"], culprit["tensor"]) == expected
    assert culprit["ratio"] > 4
    assert {r.module for r in compare_files(ref, tgt).local if r.flagged} == flagged


def test_replaying_one_layer_that_hands_its_input_on_matches(references):
    """`oneiter replay --layer`: the handed-on input gets no gradient seed there either (its recorded gradient is
    every consumer's), so a clean layer checks exact and no note blames a derived output."""
    res = run_cli("replay", references(HANDOFF), "--layer", "blocks.1", "--model", HANDOFF)
    assert res.exit_code == 0, res.output
    assert "note:" not in res.output and "grad_input.1" in res.output
