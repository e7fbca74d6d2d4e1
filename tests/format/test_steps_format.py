"""What a reader refuses in a multi-step recording and in `/optimizer_state` (`format/validate.py`,
`format/consistency.py`): each mutation of `mutants.STEPS_MUTATIONS` on the 3-step MLP recording is one line, exit
2, from `compare` and `inspect` alike, naming what is wrong; a gradient norm scaled in every step (which no statistic
contradicts: the signature is measured apart from them) is no refusal but a divergence (exit 1, never a match)."""

from __future__ import annotations

import mutants
import pytest
from conftest import run_cli

SAID = {  # mutation -> what the one line says (after "error: '<file>': ")
    ("steps_attr", 2): "root attribute 'steps' is 2 but the file holds 3 step group(s) under /steps",
    ("steps_attr", 0): "root attribute 'steps': expected an integer from 1 to 10**9",
    ("steps_attr", "3"): "root attribute 'steps': expected an integer, got '3' (str)",
    ("rename_step", "x"): "'/steps/x': expected /steps/<step>, a step number, got 'x'",
    ("rename_step", "7"): "step group '/steps/7' holds iteration 1, expected 7",
    ("iteration", 2): "step group '/steps/1' holds iteration 2, expected 1",
    ("step_attr", ("complete", False)): "step group '/steps/1': is incomplete",
    ("step_attr", ("steps", 3)): "step group '/steps/1' has attribute 'steps': a step holds no steps of its own",
    ("nested", None): "'/steps/1/steps': a step holds no steps of its own",
    ("signature", "rows"): "/signature has 2 rows for 3 steps",
    ("signature", "float32"): "'/signature': expected a float64 table of one row per step",
    ("signature", "negative"): "/signature: a norm below 0",
    ("signature", "loss"): "/signature: step 0's loss is",
    ("columns", "swap"): "/signature: columns must be 'loss', then 'grad:<parameter>' and 'update:<parameter>'",
    ("columns", "rename"): "/signature: columns must be 'loss', then",
    ("optimizer_missing", None): "root attribute 'optimizer_state' is 'recorded' but the file holds no "
                                 "/optimizer_state",
    ("optimizer_rename", "nowhere.weight.momentum_buffer"): "/optimizer_state/nowhere.weight.momentum_buffer: "
                                                            "'nowhere.weight' is no parameter of the file",
    ("optimizer_rename", "0.weight.9x"): "'/steps/0/optimizer_state/0.weight.9x': expected an optimizer state "
                                         "value named <parameter>.<key>",
    ("optimizer_value", "empty"): "the file holds /optimizer_state but its root attribute 'optimizer_state' is "
                                  "'empty', expected 'recorded' or 'loaded'",
}


@pytest.fixture(scope="session")
def pair(mlp_pair):
    return mlp_pair  # the MLP recordings, made once per session (conftest)


def test_an_untouched_copy_matches_bit_for_bit(pair):
    res = run_cli("compare", pair.steps_ref, pair.steps_ref)
    assert res.exit_code == 0 and res.stdout.startswith("MATCH: all 3 steps bitwise the reference's")


@pytest.mark.parametrize("kind, value", mutants.STEPS_MUTATIONS, ids=lambda v: str(v))
def test_every_multi_step_mutation_is_refused_or_never_a_match(pair, tmp_path, kind, value):
    mutation = mutants.Mutation("steps", "steps", "", kind, value)
    mutant = mutants.apply(pair, mutation, tmp_path / "mutant.h5", tmp_path)
    found = mutants.check(pair, mutation, mutant)
    assert mutants.outcome(found) == "clean", found
    if (kind, value) == ("signature", "scaled"):  # a gradient norm 1000x: outside the tolerance, named
        assert found["compare_exit"] == 1 and "DIVERGED at step 0" in run_cli("compare", pair.steps_ref,
                                                                               mutant).stdout
        return
    assert (found["compare_exit"], found["inspect_exit"]) == (2, 2), found
    line = found["inspect_stderr"].strip()
    assert line.count("\n") == 0 and line.startswith(f"error: '{mutant}'"), line
    if (kind, value) in SAID:
        assert SAID[(kind, value)] in line, line
