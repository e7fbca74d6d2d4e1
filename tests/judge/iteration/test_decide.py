"""`decide()` rule by rule, on hand-built `CompareResult`s (no recording): which finding the verdict names, its
status, basis, focus and exit code, and the sentence it leads with."""

from __future__ import annotations

import math
from typing import Optional

import pytest

from oneiter.judge.iteration.entries import LocalMetrics, LocalResult, Row
from oneiter.judge.iteration.findings import PRIORITY, Finding, row_findings, strongest
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.verdict import (
    FOCUS,
    Verdict,
    calibration_reason,
    culprit_reason,
    decide,
    decide_ranked,
    settle_rows,
)
from oneiter.judge.measure.metrics import Metrics
from oneiter.judge.measure.tolerance import Tolerance

TOL = Tolerance(atol=1e-5, rtol=1.3e-6)
MODULES = ["a", "b", "c", "d", "e"]


def metrics(rel_l2: float = 0.0, nan_target: int = 0) -> Metrics:
    out = 8 if rel_l2 > 1e-3 else 0
    return Metrics(num_elements=8, max_abs=rel_l2, max_rel=rel_l2, rel_l2=rel_l2, cosine=1.0, num_out=out,
                   frac_out=out / 8, need_atol=rel_l2, need_rtol=rel_l2, num_nan_ref=0, num_inf_ref=0,
                   num_nan_target=nan_target, num_inf_target=0)


def row(module: str, status: str = "match", rel_l2: float = 0.0, nan_target: int = 0) -> Row:
    """`module@0 forward output`; measured unless its status is structural (missing, shape, dtype)."""
    if status in ("missing_in_target", "shape_mismatch", "dtype_mismatch"):
        return Row(module, 0, "forward", "output", status, shape=(8,), dtype="float32", reason=status)
    return Row(module, 0, "forward", "output", status, shape=(8,), dtype="float32", shape_target=(8,),
               dtype_target="float32", tolerance=TOL, metrics=metrics(rel_l2, nan_target),
               reason="outside" if status == "diverged" else "")


def local(module: str, rel_l2: float = 1e-7, flagged: bool = False, mismatch: int = 0) -> LocalResult:
    m = LocalMetrics(8, rel_l2, rel_l2, 1.0, 0, 0, mismatch, 0, mismatch)
    return LocalResult(module, 0, "forward", "output", "float32", 0, m, 1e-6, "", 1e-6, 4.0, flagged)


def untrusted(module: str, rel_l2: float = 2e-7) -> LocalResult:
    """A call whose calibration claimed 2e-3 where float32 can produce 1.2e-7 (the bound, its expected noise now);
    flagged when its own error is above 4x that."""
    m = LocalMetrics(8, rel_l2, rel_l2, 1.0, 0, 0, 0, 0, 0)
    return LocalResult(module, 0, "forward", "output", "float32", 0, m, 2e-3, "cpu", 1.2e-7, 4.0,
                       rel_l2 > 4 * 1.2e-7, 1.2e-7)


def compare(rows: list[Row], *, local_kind: str = "", local_results: tuple = (), unexplained: tuple = (),
            loss: Optional[str] = None) -> CompareResult:
    """A result as the engine leaves it: blame's findings (the culprit: the first flagged local result; the
    unexplained entries and the loss only when no call is blamed), rows settled, then what the rows show."""
    first = next((i for i, r in enumerate(rows) if r.status != "match"), None)
    result = CompareResult("ref.h5", "tgt.h5", {}, {}, rows, first, local_kind=local_kind, local=list(local_results))
    culprit = next((r for r in result.local if r.flagged), None)
    if culprit is not None:
        index = next((i for i, r in enumerate(rows) if r.module == culprit.module), None)
        found = [Finding.of("culprit", index, culprit_reason(culprit), culprit)]
    else:
        found = [Finding.of("unexplained", i, why) for i, why in unexplained]
        found += [Finding.of("loss", None, loss)] if loss else []
    found += [Finding.of("calibration", next(i for i, r in enumerate(rows) if r.module == u.module),
                         calibration_reason(u), u) for u in result.local if u.untrusted and not u.flagged]
    settle_rows(result, found)
    result.findings = found + row_findings(rows, first, bool(local_kind))
    return result


TF = "teacher_forced"
CLEAN = (local("a"), local("b"), local("c"))
# (id, result, status, basis, focus, index the verdict names, how its headline starts)
CASES = [
    ("match, no local data", lambda: compare([row("a"), row("b", rel_l2=1e-7)]),
     "match", "first_divergence", None, None, "MATCH: all 2 entries within tolerance (largest rel_l2 1.00e-07)"),
    ("first divergence, no local data", lambda: compare([row("a"), row("b", "diverged", 0.1), row("c", "diverged", 1)]),
     "diverged", "first_divergence", "first divergence", 1, "DIVERGED at b@0 forward output"),
    ("first divergence beats a structural difference after it, no local data",
     lambda: compare([row("a", "diverged", 0.1), row("b", "missing_in_target")]),
     "diverged", "first_divergence", "first divergence", 0, "DIVERGED at a@0 forward output"),
    ("first divergence beats the loss, no local data",
     lambda: compare([row("a"), row("b", "diverged", 0.1)], loss="the loss differs"),
     "diverged", "first_divergence", "first divergence", 1, "DIVERGED at b@0 forward output"),
    ("only the loss, no local data", lambda: compare([row("a"), row("b")], loss="the loss differs: 1 vs 2"),
     "diverged", "first_divergence", "loss", None, "DIVERGED at the loss"),
    ("local data, nothing flagged: match", lambda: compare([row("a"), row("b", "diverged", 0.1), row("c")],
                                                           local_kind=TF, local_results=CLEAN),
     "match", "local_error", None, None, "MATCH: no call's own error exceeds its expected noise x4"),
    ("local data, no local result: inconclusive", lambda: compare([row("a"), row("b")], local_kind=TF),
     "inconclusive", "local_error", None, None, "INCONCLUSIVE: no call's own error could be measured"),
    ("culprit", lambda: compare([row("a"), row("b", "diverged", 0.1), row("c", "diverged", 0.2)], local_kind=TF,
                                local_results=(local("a"), local("b", 0.1, True), local("c"))),
     "diverged", "local_error", "culprit", 1, "DIVERGED: culprit b@0 forward output (#1)"),
    ("culprit later than the first divergence (drift before it)",
     lambda: compare([row("a", "diverged", 0.01), row("b", "diverged", 0.1)], local_kind=TF,
                     local_results=(local("a"), local("b", 0.1, True))),
     "diverged", "local_error", "culprit", 1, "DIVERGED: culprit b@0 forward output (#1)"),
    ("a structural difference beats the culprit", lambda: compare(
        [row("a"), row("b", "diverged", 0.1), row("c", "shape_mismatch")], local_kind=TF,
        local_results=(local("a"), local("b", 0.1, True))),
     "diverged", "local_error", "structural difference", 2, "DIVERGED at c@0 forward output"),
    ("the first of two structural differences", lambda: compare(
        [row("a"), row("b", "dtype_mismatch"), row("c", "missing_in_target")], local_kind=TF, local_results=CLEAN),
     "diverged", "local_error", "structural difference", 1, "DIVERGED at b@0 forward output"),
    ("the culprit beats a NaN/Inf difference", lambda: compare(
        [row("a", "diverged", 0.0, nan_target=1), row("b", "diverged", 0.1)], local_kind=TF,
        local_results=(local("a"), local("b", 0.1, True))),
     "diverged", "local_error", "culprit", 1, "DIVERGED: culprit b@0 forward output (#1)"),
    ("a NaN/Inf difference no call is blamed for", lambda: compare(
        [row("a"), row("b", "diverged", 0.0, nan_target=2)], local_kind=TF, local_results=CLEAN),
     "diverged", "local_error", "NaN/Inf difference", 1, "DIVERGED at b@0 forward output: NaN 0 vs 2, Inf 0 vs 0"),
    ("a NaN/Inf difference beats an unexplained entry", lambda: compare(
        [row("a", "diverged", 0.5), row("b", "diverged", 0.0, nan_target=1)], local_kind=TF, local_results=CLEAN,
        unexplained=((0, "rel_l2 5.00e-01 is more than 4x what it was computed from"),)),
     "diverged", "local_error", "NaN/Inf difference", 1, "DIVERGED at b@0 forward output"),
    ("an unexplained entry: unattributed", lambda: compare(
        [row("a"), row("b", "diverged", 0.5), row("c", "diverged", 0.6)], local_kind=TF, local_results=CLEAN,
        unexplained=((1, "rel_l2 5.00e-01 is more"), (2, "rel_l2 6.00e-01 is more")), loss="the loss differs"),
     "diverged", "unattributed", "unexplained entry", 1,
     "DIVERGED (unattributed) at b@0 forward output: no call's own code is to blame, but this entry's rel_l2 5.00e-01"),
    ("an unexplained entry inside tolerance (another precision)", lambda: compare(
        [row("a"), row("b")], local_kind=TF, local_results=CLEAN, unexplained=((1, "rel_l2 1e-3 is more"),)),
     "diverged", "unattributed", "unexplained entry", 1, "DIVERGED (unattributed) at b@0 forward output"),
    ("only the loss: unattributed", lambda: compare([row("a"), row("b", "diverged", 0.1)], local_kind=TF,
                                                    local_results=CLEAN, loss="the loss differs by 1.00e-01"),
     "diverged", "unattributed", "loss", None,
     "DIVERGED (unattributed): no call's own code is to blame, but the loss differs by 1.00e-01"),
    ("a calibration not trusted and nothing else: inconclusive, never a match", lambda: compare(
        [row("a"), row("b"), row("c")], local_kind=TF, local_results=(local("a"), untrusted("b"), local("c"))),
     "inconclusive", "local_error", "calibration not trusted", 1,
     "INCONCLUSIVE: the calibration of b@0 forward output is not trusted: its calibrated noise 2.00e-03 is 16667x "
     "what its precision can produce for it (1.20e-07, measured on the trusted path)"),
    ("an untrusted calibration with an error above its bound is the culprit", lambda: compare(
        [row("a"), row("b", "diverged", 1e-3)], local_kind=TF, local_results=(local("a"), untrusted("b", 1e-3))),
     "diverged", "local_error", "culprit", 1, "DIVERGED: culprit b@0 forward output (#1): its own code's error rel_l2 "
     "1.00e-03, on the reference's inputs, is 8333.3x its expected noise 1.20e-07 (what its precision can produce for "
     "it; its calibrated noise 2.00e-03 is not trusted, far above that)"),
    ("an unexplained entry beats an untrusted calibration", lambda: compare(
        [row("a"), row("b"), row("c", "diverged", 0.5)], local_kind=TF,
        local_results=(local("a"), untrusted("b"), local("c")), unexplained=((2, "rel_l2 5.00e-01 is more"),)),
     "diverged", "unattributed", "unexplained entry", 2, "DIVERGED (unattributed) at c@0 forward output"),
    ("a structural difference with no local result is no inconclusive", lambda: compare(
        [row("a"), row("b", "missing_in_target")], local_kind=TF),
     "diverged", "local_error", "structural difference", 1, "DIVERGED at b@0 forward output"),
]


@pytest.mark.parametrize("make, status, basis, focus, index, headline", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(make, status, basis, focus, index, headline):
    verdict = decide(make())
    assert (verdict.status, verdict.basis, verdict.focus, verdict.index) == (status, basis, focus, index)
    assert verdict.exit_code == {"match": 0, "diverged": 1, "inconclusive": 2}[status]
    assert verdict.headline.startswith(headline), verdict.headline


def test_with_local_data_the_first_divergence_is_drift_and_a_detail():
    result = compare([row("a", "diverged", 0.01), row("b", "diverged", 0.1)], local_kind=TF,
                     local_results=(local("a"), local("b", 0.1, True)))
    verdict = decide(result)
    assert [r.status for r in result.rows] == ["drift", "diverged"]
    assert verdict.first_divergence["index"] == 0 and verdict.first_divergence["entry_status"] == "drift"
    assert verdict.details[-1].startswith("first divergence: #0 a@0 forward output")
    assert not any(f.kind == "first_divergence" for f in result.findings)  # no basis with local data
    assert verdict.roles(0) == ["first_divergence"] and verdict.roles(1) == ["verdict", "culprit"]


def test_a_flagged_row_inside_tolerance_is_diverged_and_says_why():
    result = compare([row("a"), row("b")], local_kind=TF, local_results=(local("a"), local("b", 1e-4, True)))
    assert result.rows[1].status == "diverged" and result.rows[1].reason.startswith("inside tolerance, but its own")
    assert decide(result).focus == "culprit"


def test_unexplained_entries_and_the_loss_are_listed_whatever_is_named():
    result = compare([row("a"), row("b", "diverged", 0.5)], local_kind=TF, local_results=CLEAN,
                     unexplained=((1, "rel_l2 5.00e-01 is more"),), loss="the loss differs")
    verdict = decide(result)
    assert [(u["index"], u["why"]) for u in verdict.unexplained] == [(1, "rel_l2 5.00e-01 is more")]
    assert verdict.loss_unexplained == "the loss differs"
    assert result.rows[1].status == "diverged" and result.rows[1].reason == "rel_l2 5.00e-01 is more"


def test_priorities_are_one_table_and_the_strongest_wins():
    assert set(PRIORITY) == set(FOCUS) and len(set(PRIORITY.values())) == len(PRIORITY)
    assert sorted(PRIORITY, key=PRIORITY.get, reverse=True) == [
        "collective", "first_divergence", "structural", "culprit", "nan_inf", "unexplained", "loss", "calibration"]
    found = [Finding.of("loss", None), Finding.of("unexplained", 3), Finding.of("unexplained", 1)]
    assert strongest(found) is found[1]  # of equals, the first recorded (causal order)
    assert strongest([]) is None


@pytest.mark.parametrize("case", [c for c in CASES], ids=[c[0] for c in CASES])
def test_from_dict_rebuilds_the_verdict(case):
    verdict = decide(case[1]())
    assert Verdict.from_dict(verdict.as_dict()) == verdict


def test_every_untrusted_calibration_is_listed_with_both_figures():
    verdict = decide(compare([row("a"), row("b", "diverged", 1e-3), row("c")], local_kind=TF,
                             local_results=(local("a"), untrusted("b", 1e-3), untrusted("c"))))
    assert verdict.focus == "culprit" and [(u["module"], u["flagged"]) for u in verdict.untrusted] == [
        ("b", True), ("c", False)]
    assert verdict.untrusted[0]["calibrated"] == 2e-3 and verdict.untrusted[0]["bound"] == 1.2e-7
    line = next(d for d in verdict.details if d.startswith("calibration not trusted (2 tensors): "))
    assert "b@0 forward output: its calibrated noise 2.00e-03 is 16667x what its precision can produce" in line
    assert "c@0 forward output" in line and "(within that with its own error 2.00e-07)" in line


def test_ranks_inconclusive_say_why_their_first_is():
    clean = decide(compare([row("a"), row("b")], local_kind=TF, local_results=(local("a"), local("b"))))
    untrusted_b = decide(compare([row("a"), row("b")], local_kind=TF, local_results=(local("a"), untrusted("b"))))
    ranked = decide_ranked({0: clean, 1: untrusted_b})
    assert (ranked.status, ranked.exit_code) == ("inconclusive", 2)
    assert ranked.headline == "INCONCLUSIVE on rank 1 of 2: the calibration of b@0 forward output is not trusted"
    nothing = decide(compare([row("a")], local_kind=TF))
    assert decide_ranked({0: nothing, 1: clean}).headline == (
        "INCONCLUSIVE on rank 0 of 2: no call's own error could be measured")


def test_from_dict_reads_a_saved_json_verdict():
    from oneiter.judge.iteration.verdict import json_ready

    result = compare([row("a", "diverged", math.inf), row("b", "diverged", 0.1)], local_kind=TF,
                     local_results=(local("a"), local("b", 0.1, True, mismatch=1)))
    saved = json_ready(decide(result).as_dict())
    assert saved["culprit"]["ratio"] == "inf"
    rebuilt = Verdict.from_dict(saved)
    assert rebuilt.culprit.ratio == math.inf and json_ready(rebuilt.as_dict()) == saved


def test_a_culprit_that_ran_compiled_gets_the_next_commands():
    """The calls inside a compiled block are not observable: the verdict says how to go further, the node of its graph
    (`replay --layer --ops --compile`) or smaller blocks (`--compile-modules`); a culprit that did not run compiled
    gets no such line."""
    result = compare([row("a", "diverged", 1e-2), row("b")], local_kind=TF,
                     local_results=(local("a", 1e-2, flagged=True), local("b")))
    assert decide(result).hint is None
    result.compiled = {"target": {"blocks": {"a": {"backend": "inductor", "graphs": 2}}}}
    result.meta_target = {"model": "net.py:build"}
    verdict = decide(result)
    assert verdict.hint == (
        "next: a ran compiled (inductor), so the calls inside it are not observable: `oneiter replay ref.h5 --layer a "
        "--call 0 --ops -m net.py:build --compile inductor` judges each node of its graph (forward); `oneiter record "
        "... --compile inductor --compile-modules '^a\\.[^.]+$'` compiles each of its children as a block of its own, "
        "so the next compare names the call inside it")
    assert verdict.lines[1] == verdict.hint and Verdict.from_dict(verdict.as_dict()).lines == verdict.lines
