"""The unexplained-entry rule (`blame.unexplained_rows`) on hand-built rows: what an entry no probe covers may
inherit. The gradient a model's output receives comes from the loss, and, for an output the model also consumes
itself (BART's `encoder_last_hidden_state`, read by every decoder layer's cross-attention), from the model's own
backward: it is summed from those consumers, computed before it."""

from __future__ import annotations

from oneiter.judge.iteration.blame import NoisePolicy, unexplained_rows
from oneiter.judge.iteration.engine import Row
from oneiter.judge.measure.metrics import Metrics
from oneiter.judge.measure.tolerance import Tolerance

TOL = Tolerance(atol=1e-5, rtol=1.6e-2)


def _row(module: str, phase: str, tensor: str, rel_l2: float) -> Row:
    m = Metrics(num_elements=8, max_abs=rel_l2, max_rel=rel_l2, rel_l2=rel_l2, cosine=1.0, num_out=8, frac_out=1.0,
                need_atol=rel_l2, need_rtol=rel_l2, num_nan_ref=0, num_inf_ref=0, num_nan_target=0, num_inf_target=0)
    return Row(module, 0, phase, tensor, "diverged", shape=(8,), dtype="float32", shape_target=(8,),
               dtype_target="float32", tolerance=TOL, metrics=m, reason="outside")


def _found(grad_of_consumed: float) -> list:
    rows = [
        _row("(root)", "forward", "output.logits", 2e-2),
        _row("(root)", "forward", "output.encoder_last_hidden_state", 1e-2),
        _row("(root)", "backward", "grad_output.logits", 2e-2),  # from the loss: first in backward
        _row("decoder.layers.1.encoder_attn.k_proj", "backward", "grad_input.0", 3e-1),  # bf16 backward drift
        _row("(root)", "backward", "grad_output.encoder_last_hidden_state", grad_of_consumed),
    ]
    return unexplained_rows(rows, set(), NoisePolicy(), same_precision=False, loss={"reference": 4.6, "target": 4.6},
                            covered=set(), amp="bf16")


def test_a_gradient_summed_from_the_models_own_consumers_inherits_their_drift():
    assert _found(5e-1) == []  # 0.5: within 4x the 0.3 of what it was summed from


def test_it_is_still_held_to_them():
    found = _found(2.0)
    assert [f.entry for f in found] == [4] and "more than 4x what it was computed from (3.00e-01)" in found[0].reason
