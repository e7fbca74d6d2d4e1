"""Blame on model code nobody on this project wrote, with the fault inside the model's code.

Tiny Hugging Face models from random configs (Llama: keyword-called layers and functional attention; GPT-2:
dropout, eager attention, the loss computed inside the model) and a CNN with functional code in its own
`forward`. The faults are not oneiter's: each model file reads ONEITER_TEST_FAULT in its builder and wraps an
instance's forward, patches a class, or replaces a torch function (forward, or backward only) — the ways a
target's software stack differs (see model_files/faultkit.py). Every faulted run must name the exact module call
and phase, exit 1; every clean run (exact, another thread count, bf16, fp16) must be MATCH, exit 0.
"""

from __future__ import annotations

import json

import pytest
from conftest import MODEL_FILES, compare_verdict, record_small, replay, replay_with_fault, run_cli

from oneiter.judge.iteration.engine import compare_files

LLAMA = str(MODEL_FILES / "hf_llama.py:build")
GPT2 = str(MODEL_FILES / "hf_gpt2.py:build")
CNN = str(MODEL_FILES / "functional_cnn.py:build")
BERT = str(MODEL_FILES / "hf_bert.py:build")
UNET = str(MODEL_FILES / "unet.py:build")
MIXER = str(MODEL_FILES / "mixer.py:build")
UNPROBEABLE = str(MODEL_FILES / "unprobeable.py:build")

pytest.importorskip("transformers")


# (model, fault, replay options, expected culprit: module, call, phase, tensor or None)
FAULTED = [
    # functional code in the model's own forward: the root is to blame for what it hands `shared`'s second call
    (CNN, "root", {}, ("(root)", 0, "forward", "shared@1:input.0")),
    (CNN, "function:avg_pool2d", {}, ("(root)", 0, "forward", "shared@1:input.0")),
    # a shared block whose kernel is wrong only for its second call's shape (4x4)
    (CNN, "instance:shared@4", {}, ("shared", 1, "forward", "output")),
    # a module called with keyword arguments only (one non-tensor, one None)
    (CNN, "instance:head", {}, ("head", 0, "forward", "output")),
    (CNN, "class:Block", {}, ("block", 0, "forward", "output")),
    # backward only: gelu's gradient, inside `shared`'s own code (backward runs call 1 first)
    (CNN, "function_bwd:gelu", {}, ("shared", 1, "backward", "shared.conv@1:grad_output")),
    (CNN, "root:0.02", {"amp": "bf16"}, ("(root)", 0, "forward", "shared@1:input.0")),
    (CNN, "root:1e-4", {"threads": 1}, ("(root)", 0, "forward", "shared@1:input.0")),
    # Hugging Face Llama: keyword-called attention, functional attention math, a hub-style class patch
    (LLAMA, "function:silu", {}, ("model.layers.0.mlp.act_fn", 0, "forward", "output")),
    (LLAMA, "function_bwd:silu", {}, ("model.layers.1.mlp.act_fn", 0, "backward", "grad_input.0")),
    (LLAMA, "function:scaled_dot_product_attention", {},
     ("model.layers.0.self_attn", 0, "forward", "model.layers.0.self_attn.o_proj@0:input.0")),
    (LLAMA, "class:LlamaRMSNorm", {}, ("model.layers.0.input_layernorm", 0, "forward", "output")),
    (LLAMA, "instance:model.layers.0.self_attn", {}, ("model.layers.0.self_attn", 0, "forward", "output.0")),
    (LLAMA, "instance:model.layers.1.mlp.down_proj:0.02", {"amp": "bf16"},
     ("model.layers.1.mlp.down_proj", 0, "forward", "output")),
    (LLAMA, "function:scaled_dot_product_attention:0.03", {"amp": "bf16"},
     ("model.layers.0.self_attn", 0, "forward", "model.layers.0.self_attn.o_proj@0:input.0")),
    # Hugging Face GPT-2: dropout replayed inside the reruns, eager softmax attention, loss inside the model
    (GPT2, "function:softmax", {}, ("gpt.transformer.h.0.attn", 0, "forward",
                                    "gpt.transformer.h.0.attn.c_proj@0:input.0")),
    (GPT2, "function_bwd:gelu", {}, ("gpt.transformer.h.1.mlp.act", 0, "backward", "grad_input.0")),
    (GPT2, "class:GPT2MLP", {}, ("gpt.transformer.h.0.mlp", 0, "forward", "output")),
    (GPT2, "function:cross_entropy", {}, ("gpt", 0, "forward", "output.loss")),
    (GPT2, "instance:gpt.transformer.h.1.mlp.c_fc:0.03", {"amp": "bf16"},
     ("gpt.transformer.h.1.mlp.c_fc", 0, "forward", "output")),
    # Hugging Face BERT: a padding mask, attention weights returned up two levels and consumed on the way
    (BERT, "function:softmax", {}, ("bert.encoder.layer.0.attention.self", 0, "forward", "output.0")),
    (BERT, "function_bwd:softmax", {},
     ("bert.encoder.layer.1.attention.self", 0, "backward", "bert.encoder.layer.1.attention.self.key@0:grad_output")),
    (BERT, "class:BertIntermediate", {}, ("bert.encoder.layer.0.intermediate", 0, "forward", "output")),
    # U-Net: skip concatenation and upsampling in the root's own code
    (UNET, "function:interpolate", {}, ("(root)", 0, "forward", "up1@0:input.0")),
    (UNET, "function_bwd:interpolate", {}, ("(root)", 0, "backward", "up1@0:grad_output")),
    # MLP-Mixer: functional layer norm and gelu inside the mixing blocks
    (MIXER, "function:layer_norm", {}, ("layers.0.token_mix", 0, "forward", "layers.0.token_mix.fc1@0:input.0")),
    (MIXER, "function_bwd:gelu", {}, ("layers.1.channel_mix", 0, "backward",
                                      "layers.1.channel_mix.fc1@0:grad_output")),
]


def _sweep(cases: list[tuple], ids: list[str]) -> list:
    """The first case of each model runs in the fast loop, the rest of the sweep is `slow` (CI runs every case): a
    case is a replay with every call probed, 2-10 s on 2 cores."""
    seen: set[str] = set()
    params = []
    for case, name in zip(cases, ids, strict=True):
        params.append(pytest.param(*case, id=name, marks=[pytest.mark.slow] if case[0] in seen else []))
        seen.add(case[0])
    return params


@pytest.mark.parametrize("spec,fault,options,expected", _sweep(
    FAULTED, [f"{s.rpartition('/')[2].split('.')[0]}-{f}-{'-'.join(map(str, o.values())) or 'fp32'}"
              for s, f, o, _ in FAULTED]))
def test_a_fault_in_model_code_is_named(spec, fault, options, expected, references, tmp_path, monkeypatch):
    ref, tgt = references(spec), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, fault, monkeypatch, **options)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    culprit = verdict["culprit"]
    assert code == 1 and verdict["status"] == "diverged" and verdict["basis"] == "local_error", verdict
    assert (culprit["module"], culprit["call"], culprit["phase"], culprit["tensor"]) == expected
    assert culprit["ratio"] > 4
    # the chain starts at the culprit and ends at the model; a call that merely contains a wrapped or patched
    # module is not flagged (a replaced torch function may also be used by an ancestor's own code: flagged too)
    chain = verdict["chain"]
    assert chain[0]["module"] == expected[0] and chain[-1]["module"] == "(root)"
    if fault.startswith(("instance:", "class:")):
        assert all(not link["flagged"] for link in chain[1:]), chain


CLEAN = [(spec, options) for spec in (CNN, LLAMA, GPT2)
         for options in ({"seed": 3}, {"threads": 1}, {"amp": "bf16"}, {"amp": "fp16"})]
CLEAN += [(spec, options) for spec in (BERT, UNET, MIXER) for options in ({"threads": 1}, {"amp": "bf16"})]
CLEAN += [(CNN, {"dtype": "bfloat16"}), (LLAMA, {"dtype": "float64"})]


@pytest.mark.parametrize("spec,options", _sweep(
    CLEAN, [f"{s.rpartition('/')[2].split('.')[0]}-{'-'.join(map(str, o.values()))}" for s, o in CLEAN]))
def test_clean_targets_are_a_match(spec, options, references, tmp_path):
    ref, tgt = references(spec), tmp_path / "tgt.h5"
    replay(ref, tgt, **options)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict
    assert verdict["unprobed"] == [] and verdict["num_local"] > 20


def test_every_call_is_probed_including_keyword_calls_and_the_root(references, tmp_path):
    ref, tgt = references(LLAMA), tmp_path / "tgt.h5"
    replay(ref, tgt, amp="bf16")
    result = compare_files(ref, tgt)
    probed = {(r.module, r.call) for r in result.local if r.phase in ("forward", "backward")}
    # the root, the keyword-called decoder layers and attention modules, and the leaves
    for call in ("(root)", "model", "model.layers.0", "model.layers.0.self_attn", "model.layers.1.mlp.act_fn"):
        assert (call, 0) in probed, call
    assert {r.phase for r in result.local} == {"forward", "backward", "param_grad", "optimizer"}
    assert result.unprobed == []


def test_a_cache_argument_is_snapshotted_for_the_rerun(tmp_path, monkeypatch):
    """With use_cache=True the attention appends to a DynamicCache passed by keyword: the rerun must see the
    cache as it was before the call, not with this layer's keys already in it."""
    ref, clean, faulty = tmp_path / "ref.h5", tmp_path / "clean.h5", tmp_path / "faulty.h5"
    record_small(ref, LLAMA, batch_size=2, model_args={"use_cache": True})
    replay(ref, clean)
    assert compare_files(ref, clean).status == "match"
    replay_with_fault(ref, faulty, "function:scaled_dot_product_attention", monkeypatch)
    verdict = compare_files(ref, faulty).verdict()
    assert verdict["culprit"]["module"] == "model.layers.0.self_attn"


def test_calibrating_on_the_device_names_the_same_culprit(references, tmp_path, monkeypatch):
    ref, clean, faulty = references(LLAMA), tmp_path / "clean.h5", tmp_path / "faulty.h5"
    replay(ref, clean, amp="bf16", calibrate="device")
    result = compare_files(ref, clean)
    assert result.status == "match"
    assert {r.calibration for r in result.local if r.calibrated is not None} == {"device"}
    replay_with_fault(ref, faulty, "instance:model.layers.1.mlp.down_proj:0.03", monkeypatch, amp="bf16",
                      calibrate="device")
    culprit = compare_files(ref, faulty).verdict()["culprit"]
    assert (culprit["module"], culprit["phase"]) == ("model.layers.1.mlp.down_proj", "forward")


def test_calibrate_option_on_the_command_line(references, tmp_path):
    ref = references(CNN)
    res = run_cli("record", "--replay", ref, "--model", CNN, "--amp", "bf16", "--calibrate", "device",
                  "-o", tmp_path / "t.h5")
    assert res.exit_code == 0, res.output
    assert run_cli("compare", ref, tmp_path / "t.h5").exit_code == 0
    res = run_cli("record", "--replay", ref, "--model", CNN, "--calibrate", "gpu", "-o", tmp_path / "u.h5")
    assert res.exit_code == 2 and "--calibrate takes 'cpu' or 'device'" in res.stderr
    assert not (tmp_path / "u.h5").exists()


def test_a_call_that_cannot_be_rerun_is_judged_inside_its_parent(tmp_path, monkeypatch):
    ref, clean, faulty = tmp_path / "ref.h5", tmp_path / "clean.h5", tmp_path / "faulty.h5"
    record_small(ref, UNPROBEABLE, batch_size=4)
    replay(ref, clean)
    result = compare_files(ref, clean)
    assert result.status == "match"
    assert [(u["module"], u["reason"]) for u in result.unprobed] == [
        ("once", "rerun failed: RuntimeError: Once ran twice in one iteration")]
    replay_with_fault(ref, faulty, "instance:once", monkeypatch)
    code, verdict = compare_verdict(ref, faulty, tmp_path)
    assert code == 1 and verdict["culprit"]["module"] == "(root)"
    assert verdict["culprit"]["tensor"] == "out@0:input.0"
    assert [u["module"] for u in verdict["culprit_includes"]] == ["once"]


def test_a_fault_no_probe_can_see_is_unattributed_not_a_match(references, tmp_path, monkeypatch):
    """The loss function runs outside the model: a wrong cross_entropy there is no call's fault."""
    ref, tgt = references(CNN), tmp_path / "tgt.h5"
    replay_with_fault(ref, tgt, "function:cross_entropy", monkeypatch)
    code, verdict = compare_verdict(ref, tgt, tmp_path)
    assert code == 1 and verdict["status"] == "diverged" and verdict["basis"] == "unattributed", verdict
    assert verdict["culprit"] is None and "loss" in verdict["loss_unexplained"]
    res = run_cli("compare", ref, tgt)
    assert res.stdout.startswith("DIVERGED (unattributed)")


def test_against_cpu_probes_keyword_calls_and_containers(tmp_path):
    clean, faulty = tmp_path / "clean.h5", tmp_path / "faulty.h5"
    record_small(clean, LLAMA, batch_size=2, amp="bf16", against="cpu")
    res = run_cli("compare", clean)
    assert res.exit_code == 0, res.output
    record_small(faulty, LLAMA, batch_size=2, amp="bf16", against="cpu",
                 faults=["model.layers.1.mlp.up_proj:forward=0.03"])
    res = run_cli("compare", faulty, "--json", tmp_path / "r.json")
    assert res.exit_code == 1
    culprit = json.loads((tmp_path / "r.json").read_text())["verdict"]["culprit"]
    assert (culprit["module"], culprit["phase"]) == ("model.layers.1.mlp.up_proj", "forward")
