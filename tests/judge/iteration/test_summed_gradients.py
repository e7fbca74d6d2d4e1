"""A gradient summed from its readers' gradients is explained by theirs (`judge/iteration/summed.py`).

The gradient a model output receives is the loss's part plus what every call that read the output inside the model
hands back for it (T5's and BART's `encoder_last_hidden_state`, read by each decoder layer's cross-attention;
Wav2Vec2's `extract_features`, read by its projection). Under bf16 it inherits their drift; a sum whose terms
cancel (a loss flat in exact arithmetic: every gradient upstream of the final norm is rounding) inherits it relative
to its own, tiny, size. Hand-built rows first, then the real models: clean bf16 replays MATCH, with a token loss and
with the flat one, and a 5e-2 fault in a decoder cross-attention's `k` projection is still named.
"""

from __future__ import annotations

import pytest
from conftest import MODEL_FILES, record_small, replay, replay_with_fault

from oneiter.judge.iteration.blame import NoisePolicy, Sources, unexplained_rows
from oneiter.judge.iteration.engine import Row, compare_files
from oneiter.judge.measure.metrics import Metrics
from oneiter.judge.measure.tolerance import Tolerance

TOL = Tolerance(atol=1e-5, rtol=1.6e-2)
OUT = ("(root)", 0, "forward", "output.encoder_last_hidden_state")


def _row(key: tuple, rel_l2: float) -> Row:
    m = Metrics(num_elements=8, max_abs=rel_l2, max_rel=rel_l2, rel_l2=rel_l2, cosine=1.0, num_out=8, frac_out=1.0,
                need_atol=rel_l2, need_rtol=rel_l2, num_nan_ref=0, num_inf_ref=0, num_nan_target=0, num_inf_target=0)
    return Row(*key, "diverged", shape=(8,), dtype="float32", shape_target=(8,), dtype_target="float32",
               tolerance=TOL, metrics=m, reason="outside")


def _found(readers: dict[str, tuple[float, float]], total: tuple[float, float], root_out: float = 1e-3) -> list:
    """The unexplained findings of a model whose output `encoder_last_hidden_state` (rel_l2, reference norm of its
    gradient: `total`) was read by the calls of `readers` (name -> rel_l2 and norm of what each handed back); the
    root's gradient row comes first in backward, as the capture orders a call's output gradients."""
    keys = [OUT, ("(root)", 0, "forward", "output.logits")] + [(n, 0, "forward", "kwarg.hidden") for n in readers]
    rows = [_row(OUT, root_out), _row(keys[1], root_out)] + [_row(k, root_out) for k in keys[2:]]
    stored = [("enc", "enc"), ("logits", "logits")] + [("enc", "enc")] * len(readers)
    grad = ("(root)", 0, "backward", "grad_output.encoder_last_hidden_state")
    rows.append(_row(grad, total[0]))
    stored.append(None)
    norms = {grad: total[1]}
    for name, (rel, size) in readers.items():
        key = (name, 0, "backward", "grad_kwarg.hidden")
        rows.append(_row(key, rel))
        stored.append(None)
        norms[key] = size
    parents = {("(root)", 0): None, **{(n, 0): ("(root)", 0) for n in readers}}
    loss = {"reference": 4.6, "target": 4.6}
    sources = Sources(rows, loss, parents, stored=stored, norm=norms.get, run_dtype="bfloat16")
    return unexplained_rows(rows, set(), NoisePolicy(), same_precision=False, loss=loss, covered=set(), amp="bf16",
                            sources=sources)


def test_the_gradient_of_an_output_the_model_reads_inherits_its_readers_drift():
    """T5: the decoder read the encoder's output; the gradient it handed back is the root's, drift and all."""
    assert _found({"decoder": (2.5e-2, 1.0)}, (2.5e-2, 1.0)) == []


def test_a_sum_whose_terms_cancel_is_rounding_relative_to_its_terms():
    """A loss flat in exact arithmetic: the sum is 1e-3 of its terms, its relative drift 5 is explained by terms
    1e-2 off; 100 is not (more than 4x their 2e-2 x 1000)."""
    readers = {"decoder.layers.0": (1e-2, 1.0), "decoder.layers.1": (1e-2, 1.0)}
    assert _found(readers, (5.0, 1e-3)) == []
    found = _found(readers, (100.0, 1e-3))
    assert [f.entry for f in found] == [4] and "what it was computed from (2.00e+01)" in found[0].reason


def test_a_gradient_its_readers_do_not_explain_is_still_unexplained():
    """The readers' gradients are 1e-3 off and as large as the sum: a 0.3 difference is the loss side's."""
    found = _found({"decoder": (1e-3, 1.0)}, (0.3, 1.0))
    assert [f.entry for f in found] == [3] and "rel_l2 3.00e-01" in found[0].reason


# -- the real models -----------------------------------------------------------------------------------------------
SELF_READ = str(MODEL_FILES / "hf_self_read.py:build")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """One float32 reference per (model, layers, loss), recorded on first use."""
    made = {}

    def get(name: str, layers: int, loss: str):
        key = (name, layers, loss)
        if key not in made:
            made[key] = tmp_path_factory.mktemp("ref") / f"{name}{layers}{loss}.h5"
            record_small(made[key], SELF_READ, threads=1, model_args={"name": name, "layers": layers, "loss": loss})
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name,layers,loss", [("t5", 3, "token"), ("t5", 3, "flat"), ("bart", 2, "flat"),
                                              ("wav2vec2", 2, "flat")])
def test_models_reading_their_own_outputs_replay_clean_under_bf16(refs, tmp_path, name, layers, loss):
    """Each was DIVERGED (unattributed) at its root's gradient of `encoder_last_hidden_state` / `extract_features`
    (T5 with 3 decoder layers: rel_l2 2.51e-02 against 5.29e-03; Wav2Vec2's flat loss: 1.39e+04)."""
    target = tmp_path / "bf16.h5"
    replay(refs(name, layers, loss), target, amp="bf16", threads=1)
    verdict = compare_files(refs(name, layers, loss), target).verdict_obj
    assert verdict.status == "match" and verdict.basis == "local_error", verdict.headline


@pytest.mark.slow
def test_a_fault_in_a_decoder_cross_attentions_k_projection_is_still_named_under_bf16(refs, tmp_path, monkeypatch):
    target = tmp_path / "fault.h5"
    replay_with_fault(refs("t5", 3, "flat"), target, "instance:decoder.block.1.layer.1.EncDecAttention.k:0.05",
                      monkeypatch, amp="bf16", threads=1)
    culprit = compare_files(refs("t5", 3, "flat"), target).verdict_obj.culprit
    assert (culprit.module, culprit.call, culprit.phase, culprit.tensor) == (
        "decoder.block.1.layer.1.EncDecAttention.k", 0, "forward", "output")
    assert culprit.ratio > 4
