"""The zoo in CI: model code nobody on this project wrote, one model of every family that ever false-alarmed.

`bench/zoo.py` sweeps every model of `tests/model_files/zoo_models.py` (Hugging Face architectures from tiny random
configs, stock torch.nn families, torchtitan's Llama) through every case; this runs its own `run_case` on the
families whose clean replays once were DIVERGED, and on faults next to what made them false-alarm:

- nn.MultiheadAttention called with one tensor in several places: TransformerEncoderLayer pre- and post-LN (q = k =
  v), TransformerDecoderLayer (key = value = memory), `attn(h, h, h)` and `attn(h, m, m)` by hand;
- a module that writes its own parameters in forward: nn.Embedding and nn.EmbeddingBag with `max_norm`;
- in-place activations after nn.Linear on 3-d inputs (a view changed in place: torch fires no hook registered on it);
- Hugging Face: DeBERTa-v2 (its encoder returns its last hidden state twice), Wav2Vec2 (SpecAugment masks drawn
  from numpy.random), BART and T5 under bf16 (an output the model also consumes: its gradient is summed from
  many consumers), ModernBERT (rotary embeddings, local attention), DINOv2 (returns a view of its last hidden
  state that nobody reads), ConvNeXt on 2 threads (a channels_last gradient; a bias gradient summing one broadcast
  value, whose float32 rounding the calibration-trust bound once put far too low), MobileNetV2 under bf16 (running
  means of zero-mean inputs: exactly 0 in bf16, and the bound's runs once left BatchNorm's running statistics
  unchanged), Swin under bf16 (torch's CPU LayerNorm backward sums its bias's gradient in bf16, which the bound once
  held to a float32 accumulator), RecurrentGemma (its RG-LRU keeps its final state, a tensor of its graph, as a
  plain attribute: the replay's own backward once failed).

A clean case must be a MATCH; a fault case must name the faulted module (or, for a torch.nn.functional fault, a
module whose own code calls the function) in the fault's phase: the outcome `ok`. torchtitan (a bench dependency)
has its state_dict case in tests/runtime/test_names.py, on a stand-in with the same hooks.
"""

from __future__ import annotations

import pytest
from conftest import load_tool

pytest.importorskip("transformers")
zoo = load_tool("zoo", "bench")

CASES = [
    ("nn_encoder_postln", "clean"), ("nn_encoder_postln", "module_bf16_fwd"),
    ("nn_encoder_preln", "bf16"), ("nn_encoder_preln", "function_bwd"),
    ("nn_decoder_postln", "threads"),
    ("nn_mha_self", "clean"), ("nn_mha_self", "module_bwd"),
    ("nn_mha_cross", "bf16"),
    ("nn_embedding", "clean"), ("nn_embedding", "module_fwd"),
    ("nn_embedding_bag", "bf16"),
    ("nn_inplace", "bf16"),
    ("deberta_v2", "clean"),
    ("wav2vec2", "bf16"),
    ("bart", "bf16"),
    ("t5", "bf16"),
    ("modernbert", "clean"), ("modernbert", "bf16"),
    ("dinov2", "clean"),
    ("convnext", "threads"),
    ("mobilenet_v2", "bf16"),
    ("swin", "bf16"),
    ("recurrent_gemma", "clean"),
]


@pytest.fixture(scope="module")
def sites():
    """The fault sites of each model, by the bench's rule (one forward each, no recording)."""
    found: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in found:
            found[name] = zoo.fault_sites(name)
        return found[name]

    return get


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One folder for the module: each model's reference is recorded there once, on first use."""
    return tmp_path_factory.mktemp("zoo")


# the Hugging Face cases take 15 to 25 s of CPU each (18 cases: 109 s of CPU in all, the torch.nn ones 1 to 6 s each)
HF = {"deberta_v2", "wav2vec2", "bart", "t5", "modernbert", "dinov2", "convnext", "mobilenet_v2", "swin",
      "recurrent_gemma"}
PARAMS = [pytest.param(n, c, id=f"{n}-{c}", marks=[pytest.mark.slow] if n in HF else []) for n, c in CASES]


@pytest.mark.parametrize("name,case", PARAMS)
def test_zoo_case(name, case, sites, work):
    res = zoo.run_case(work, name, case, sites(name))
    assert res["outcome"] == "ok", zoo.progress_line(res) + f"\n{(res.get('verdict') or {}).get('headline')}"
    verdict = res["verdict"]
    if case in zoo.CLEAN:
        assert verdict["status"] == "match" and verdict["basis"] == "local_error", verdict
    else:
        assert verdict["status"] == "diverged" and verdict["ratio"] > 4, verdict


def test_the_rule_picks_a_module_two_thirds_down_and_a_function_of_the_models_own_code(sites):
    """The fault sites are the rule's, never a choice by hand: nn_mha_self's leaves owning parameters are norm,
    ff.0, ff.2, head (MultiheadAttention's out_proj is applied by F.linear, never called); the model's own code
    calls no torch.nn.functional function, its MultiheadAttention container calls F.linear most."""
    found = sites("nn_mha_self")
    assert found["num_leaves"] == 4 and found["module"] == "ff.2"
    assert found["function"] == "linear" and found["function_first"] == "attn" and found["function_last"] == "head"
    assert zoo.expected("function_bwd", found) == {"fault": "function_bwd:linear:0.001", "phase": "backward",
                                                    "modules": ["attn", "ff.0", "ff.2", "head"], "at": "head"}


def test_the_table_goes_between_the_markers_of_a_document(tmp_path):
    """`--table docs/zoo.md` rewrites only what lies between the document's two markers; a file without them is
    the table alone."""
    doc = tmp_path / "zoo.md"
    doc.write_text(f"# prose\n\n{zoo.BEGIN}\nold table\n{zoo.END}\n\nmore prose\n")
    zoo.write_table(doc, "| a | b |\n")
    assert doc.read_text() == f"# prose\n\n{zoo.BEGIN}\n\n| a | b |\n\n{zoo.END}\n\nmore prose\n"
    zoo.write_table(doc, "| c |\n")
    assert doc.read_text() == f"# prose\n\n{zoo.BEGIN}\n\n| c |\n\n{zoo.END}\n\nmore prose\n"
    plain = tmp_path / "table.md"
    zoo.write_table(plain, "| a |\n")
    assert plain.read_text() == "| a |\n"


def test_a_bf16_miss_is_explained_by_what_its_float32_twin_measured():
    """A bf16 fault that was missed is explained from figures, never by hand: its float32 twin named the entry by an
    error that is a share of its fault; that share of the bf16 fault, against the bf16 case's noise there."""
    at = {"module": "h.1.attn", "call": 0, "phase": "backward", "tensor": "h.1.attn.c_attn@0:grad_output"}
    got = {"function_bwd": {"outcome": "ok", "verdict": {**at, "rel_l2": 1.46e-05}},
           "function_bf16_bwd": {"outcome": "missed", "verdict": {"worst_local": {**at, "ratio": 1.01, "factor": 4.0,
                                                                                  "expected": 4.21e-03}}}}
    text = zoo._below_noise("function_bf16_bwd", got)
    assert "moved h.1.attn@0 backward h.1.attn.c_attn@0:grad_output by 1.46e-05, 1.5 % of the fault" in text
    assert "so 0.05 moves it by about 0.00073, 0.17 times bf16's own noise there (0.00421" in text
    got["function_bf16_bwd"]["verdict"]["worst_local"].update(module="h.0.mlp", ratio=0.77)
    assert zoo._below_noise("function_bf16_bwd", got).endswith(
        "and no entry of this replay, that one included, is above 0.77 times its bf16 noise (flagged above 4 times)")
    got["function_bwd"]["outcome"] = "missed"
    assert zoo._below_noise("function_bf16_bwd", got) == ""
