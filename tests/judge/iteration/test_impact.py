"""Which fix matters (`record --impact`): the flagged calls ranked by the share of the gap fixing each closes, against
the ground truth of removing each fault in the model file itself and measuring the loss gap of a plain replay."""

from __future__ import annotations

import json

import pytest
from conftest import FAULT_ENV, MODEL_FILES, record_small, replay, run_cli

from oneiter.format.layout import IterationFile
from oneiter.judge.iteration.engine import compare_files

PLANTED = str(MODEL_FILES / "planted.py:build")
LLAMA = str(MODEL_FILES / "hf_llama.py:build")
# 5 % in a branch the model scales by 1e-3 before it joins the main path, 2 % in the first layer, 1 % halfway down
THREE = {"branch": "instance_below64:branch:0.05", "first": "instance_below64:first:0.02",
         "layers.4": "instance_below64:layers.4:0.01"}
# a fault in one MLP (its own code: the container's output) and a smaller one in an attention projection
LLAMA_FAULTS = {"model.layers.0.mlp": "instance_below64:model.layers.0.mlp:0.05",
                "model.layers.1.self_attn.o_proj": "instance_below64:model.layers.1.self_attn.o_proj:0.01"}


def _replay(ref, out, faults: dict, names, monkeypatch, **kwargs):
    """A replay with the model file's faults `names` (none: a clean model)."""
    import sys

    monkeypatch.setenv(FAULT_ENV, ";".join(faults[n] for n in names))
    try:
        return replay(ref, out, force=True, **kwargs)
    finally:
        monkeypatch.delenv(FAULT_ENV, raising=False)
        sys.modules["faultkit"].undo_faults()


def _truth(ref, folder, faults: dict, monkeypatch) -> dict[str, float]:
    """Per fault, the share of the loss gap removing it from the model file closes: plain replays (no probes)."""
    with IterationFile(ref) as f:
        loss_ref = float(f.read("loss").reshape(-1)[0])
    gap = abs(_replay(ref, folder / "all.h5", faults, list(faults), monkeypatch, isolate=False).loss - loss_ref)
    shares = {}
    for name in faults:
        rest = [n for n in faults if n != name]
        left = abs(_replay(ref, folder / "rest.h5", faults, rest, monkeypatch, isolate=False).loss - loss_ref)
        shares[name] = (gap - left) / gap
    return shares


def _compare(ref, tgt, folder) -> tuple[int, dict, str]:
    """`oneiter compare --json`: its exit code, the JSON report and the terminal report."""
    res = run_cli("compare", ref, tgt, "--json", folder / "report.json")
    return res.exit_code, json.loads((folder / "report.json").read_text()), res.output


@pytest.fixture(scope="module")
def planted_ref(references):
    return references(PLANTED, batch_size=8)  # the one tests/record/impact/test_impact_recorder.py reads


@pytest.fixture(scope="module")
def three_faults(planted_ref, tmp_path_factory):
    """The three planted faults: the impact replay compared, and the ground truth."""
    folder = tmp_path_factory.mktemp("three")
    with pytest.MonkeyPatch.context() as mp:
        _replay(planted_ref, folder / "npu.h5", THREE, list(THREE), mp, impact=True)
        truth = _truth(planted_ref, folder, THREE, mp)
    code, doc, terminal = _compare(planted_ref, folder / "npu.h5", folder)
    return {"code": code, "doc": doc, "terminal": terminal, "truth": truth, "tgt": folder / "npu.h5"}


def test_three_faults_are_ranked_as_removing_each_from_the_model_ranks_them(three_faults):
    truth, doc = three_faults["truth"], three_faults["doc"]
    ranking = doc["impact"]
    assert [f["module"] for f in ranking] == sorted(truth, key=lambda n: -truth[n])
    assert [f["module"] for f in ranking] == ["layers.4", "first", "branch"]
    assert abs(ranking[0]["share"] - truth["layers.4"]) < 0.1
    for fix in ranking:  # each fix closes what removing the fault closes, the gradients and weights as well
        assert fix["share"] == pytest.approx(truth[fix["module"]], abs=0.01)
        assert set(fix) >= {"module", "call", "phase", "share", "grad_share", "weight_share", "loss_gap", "grad_gap",
                            "weight_gap"}
    # the own-error ratios rank them the other way round: the harmless 5 % branch first
    by_ratio = sorted(ranking, key=lambda f: -f["ratio"])
    assert [f["module"] for f in by_ratio][0] == "branch" and ranking[-1]["module"] == "branch"
    # the culprit is the first flagged call in causal order; the verdict names the fix that matters most
    verdict = doc["verdict"]
    assert three_faults["code"] == 1 and verdict["culprit"]["module"] == "first"
    assert verdict["details"][0].startswith(f"fix first: layers.4@0 (forward output): fixing it closes "
                                            f"{100 * ranking[0]['share']:.0f} % of the loss gap")


def test_with_every_fault_fixed_nothing_is_left_in_float32(three_faults):
    impact = three_faults["doc"]["verdict"]["impact"]
    assert impact["every"]["share"] == 1.0 and impact["every"]["loss_gap"] == 0.0  # bit for bit the loss
    assert impact["every"]["grad_gap"] < 1e-5 and impact["leaves"] == 0.0
    assert "impact: with all 3 fixed, the precision alone leaves 0 % of the loss gap" in three_faults["terminal"]
    assert not impact["interacts"]


def test_the_terminal_csv_and_html_show_the_ranking(three_faults, planted_ref, tmp_path):
    import csv

    table = three_faults["terminal"][three_faults["terminal"].index("rank  call fixed"):]
    assert [line.split()[1] for line in table.splitlines()[1:4]] == ["layers.4@0", "first@0", "branch@0"]
    assert "nothing fixed" in table and "all 3 fixed" in table
    res = run_cli("compare", planted_ref, three_faults["tgt"], "--csv", tmp_path / "r.csv", "--html",
                  tmp_path / "r.html")
    assert res.exit_code == 1
    rows = list(csv.DictReader(open(tmp_path / "r.csv", newline="")))
    ranked = {(r["module"], r["phase"], r["tensor"]): r["impact_rank"] for r in rows if r["impact_rank"]}
    assert ranked == {("layers.4", "forward", "output"): "1", ("first", "forward", "output"): "2",
                      ("branch", "forward", "output"): "3"}
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Which fix matters</h2>" in page and page.index("layers.4@0") < page.index("branch@0</td>")


def test_a_damaged_impact_table_is_refused_in_one_line(three_faults, tmp_path):
    import shutil

    import h5py
    import numpy as np

    from oneiter.errors import FormatError

    damaged = tmp_path / "damaged.h5"
    shutil.copy(three_faults["tgt"], damaged)
    with h5py.File(damaged, "r+") as f:
        table = f["impact"][()]
        del f["impact"]
        names = [n for n in table.dtype.names if n != "loss_gap"]
        f.create_dataset("impact", data=np.array([tuple(r[n] for n in names) for r in table],
                                                 dtype=[(n, table.dtype[n]) for n in names]))
    with pytest.raises(FormatError, match="'/impact': column 'loss_gap': expected f8, got no such column"):
        IterationFile(damaged)


def test_a_single_fault_closes_more_than_nine_tenths_of_every_gap(planted_ref, tmp_path, monkeypatch):
    _replay(planted_ref, tmp_path / "one.h5", THREE, ["layers.4"], monkeypatch, impact=True)
    _, doc, terminal = _compare(planted_ref, tmp_path / "one.h5", tmp_path)
    [fix] = doc["impact"]
    assert fix["module"] == "layers.4" and fix["share"] > 0.9
    assert fix["grad_share"] > 0.9 and fix["weight_share"] > 0.9
    assert "impact: with it fixed, the precision alone leaves 0 % of the loss gap" in terminal


def test_a_difference_in_the_model_s_own_code_is_not_fixed_and_says_so(planted_ref, tmp_path, monkeypatch):
    """A wrapper wrong in every precision (forward, or backward only) runs in float64 too: its fix changes nothing,
    and the ranking says why instead of ranking it as harmless; a kernel wrong below float64 beside them is fixed."""
    faults = {"first": "instance:first:0.02", "layers.4": "instance_bwd:layers.4:0.01",
              "layers.6": "instance_below64:layers.6:0.01"}
    _replay(planted_ref, tmp_path / "code.h5", faults, list(faults), monkeypatch, impact=True)
    _, doc, terminal = _compare(planted_ref, tmp_path / "code.h5", tmp_path)
    ranking = doc["impact"]
    assert [(f["module"], f["phase"]) for f in ranking] == [("layers.6", "forward"), ("first", "forward"),
                                                            ("layers.4", "backward")]
    assert ranking[0]["note"] == "" and ranking[0]["share"] > 0.5
    for fix in ranking[1:]:
        assert fix["note"].startswith("not fixed: its float64 recomputation gives what it computed")
    assert doc["verdict"]["details"][0].startswith("fix first: layers.6@0 (forward output)")
    assert "impact: with all 3 fixed (2 could not be: below)" in terminal
    assert "the precision alone leaves" not in terminal


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_a_clean_replay_has_no_ranking(planted_ref, tmp_path, monkeypatch, amp):
    summary = _replay(planted_ref, tmp_path / "clean.h5", THREE, [], monkeypatch, impact=True, amp=amp)
    assert summary.impact_runs == 0  # nothing flagged: the iteration is not run again
    code, doc, terminal = _compare(planted_ref, tmp_path / "clean.h5", tmp_path)
    assert code == 0 and doc["impact"] == [] and doc["verdict"]["impact"]["num_flagged"] == 0
    assert "fix" not in terminal and "impact" not in terminal


def test_a_bf16_replay_ranks_its_fault_first_and_says_what_the_precision_leaves(planted_ref, tmp_path,
                                                                                monkeypatch):
    faults = {"layers.6": "instance_below64:layers.6:0.1"}
    _replay(planted_ref, tmp_path / "bf16.h5", faults, ["layers.6"], monkeypatch, impact=True, amp="bf16")
    code, doc, terminal = _compare(planted_ref, tmp_path / "bf16.h5", tmp_path)
    ranking, impact = doc["impact"], doc["verdict"]["impact"]
    assert code == 1 and ranking[0]["module"] == "layers.6" and ranking[0]["share"] > 0.5
    leaves = impact["leaves"]
    assert 0.0 < leaves < 0.5 and leaves == pytest.approx(1 - ranking[0]["share"])  # one fix: the all-fixed run
    assert f"the precision alone leaves {100 * leaves:.0f} % of the loss gap" in terminal


@pytest.mark.slow  # a resnet18 replay with every call probed (~15 s); the sentences are tested on a hand-built result
def test_an_iteration_a_rounding_moves_as_far_as_a_fix_ranks_nothing(resnet_ref, tmp_path):
    """resnet18 at 32x32 and batch 2: its last BatchNorms normalise over two samples of a 1x1 map, which amplify one
    rounding as much as a 2 % fault (docs/steps.md): the shares would be noise, and the verdict says so."""
    faults = ["layer1.0.conv1:forward=0.05", "layer3.0.conv1:forward=0.02"]  # stand for device kernels
    replay(resnet_ref, tmp_path / "npu.h5", faults=faults, impact=True)
    code, doc, terminal = _compare(resnet_ref, tmp_path / "npu.h5", tmp_path)
    impact = doc["verdict"]["impact"]
    assert code == 1 and len(doc["impact"]) == 2 and not impact["evidence"] and impact["sensitivity"] >= 0.5
    assert "fix first" not in terminal
    assert (f"impact: no ranking: one rounding of the weights moves the loss gap by "
            f"{100 * impact['sensitivity']:.0f} %, as far as a fix does") in terminal


def test_a_llama_ranks_its_mlp_and_attention_projection_faults_as_the_ground_truth_does(references, tmp_path,
                                                                                       monkeypatch):
    ref = references(LLAMA)
    truth = _truth(ref, tmp_path, LLAMA_FAULTS, monkeypatch)
    _replay(ref, tmp_path / "npu.h5", LLAMA_FAULTS, list(LLAMA_FAULTS), monkeypatch, impact=True)
    result = compare_files(ref, tmp_path / "npu.h5")
    fixes = result.verdict_obj.impact.fixes
    assert [f.module for f in fixes] == sorted(truth, key=lambda n: -truth[n])
    for fix in fixes:  # the MLP, a container: its own code in float64, its projections and activation live
        assert fix.share == pytest.approx(truth[fix.module], abs=0.01)


def test_over_several_steps_each_call_fixed_at_every_step_is_ranked_by_the_last_step_s_loss_gap(tmp_path,
                                                                                                 monkeypatch):
    faults = {"first": THREE["first"], "layers.4": THREE["layers.4"]}
    ref_steps, ref_one = tmp_path / "ref_steps.h5", tmp_path / "ref.step0.h5"
    record_small(ref_steps, PLANTED, batch_size=8, steps=2)
    record_small(ref_one, PLANTED, batch_size=8, step=0)  # what the steps' comparison prints for step 0
    _replay(ref_one, tmp_path / "npu.step0.h5", faults, list(faults), monkeypatch)  # its calls judged
    summary = _replay(ref_steps, tmp_path / "npu_steps.h5", faults, list(faults), monkeypatch, impact=True,
                      impact_from=tmp_path / "npu.step0.h5")
    assert summary.impact_runs == 5  # nothing fixed (and one rounding off), each of the two, both: 2 steps each
    with IterationFile(ref_steps) as f:
        loss_ref = float(f.signature().values[-1][0])
    gap = abs(summary.loss - loss_ref)
    truth = {}
    for name in faults:  # the multi-step replay without that fault, plainly: its loss at the last step
        left = abs(_replay(ref_steps, tmp_path / "rest.h5", faults, [n for n in faults if n != name],
                           monkeypatch).loss - loss_ref)
        truth[name] = (gap - left) / gap
    res = run_cli("compare", ref_steps, tmp_path / "npu_steps.h5", "--json", tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 1 and doc["verdict"]["step"] == 0
    assert [f["module"] for f in doc["impact"]] == sorted(truth, key=lambda n: -truth[n])
    for fix in doc["impact"]:
        assert fix["share"] == pytest.approx(truth[fix["module"]], abs=0.01)
    first = doc["impact"][0]
    assert (f"fix first: {first['module']}@0 (forward output), fixed at every step: it closes "
            f"{100 * first['share']:.0f} % of the loss gap at step 1") in res.output


def test_impact_over_several_steps_needs_the_calls_to_fix_and_one_iteration_finds_its_own(tmp_path):
    from oneiter.errors import OneIterError
    from oneiter.record.run import SpecOptions, record

    ref_steps = tmp_path / "ref_steps.h5"
    record_small(ref_steps, PLANTED, batch_size=8, steps=1)
    with pytest.raises(OneIterError, match="give impact_from, a replay of one iteration recorded in full"):
        record(SpecOptions(out=tmp_path / "x.h5", replay=ref_steps, model=PLANTED, impact=True))
    res = run_cli("record", "--replay", ref_steps, "--model", PLANTED, "--step", "0", "--impact", "--impact-from",
                  ref_steps, "-o", tmp_path / "y.h5")
    assert res.exit_code == 2 and "error: --impact-from" in res.output


# -- the ranking and its sentences, on hand-built results (no recording) --------------------------------------------
def _fix(module: str, share: float, note: str = "", grad_share: float = 0.5):
    from oneiter.judge.iteration.impact import Fix

    return Fix(module, 0, "forward", "output", 0.01, 100.0, share, grad_share, grad_share, 1.0 - share, 1.0, 1.0, note)


def _verdict(fixes, *, every_share: float = 1.0, loss_gap: float = 1.0, flagged: int = 0, top=None, note: str = ""):
    from oneiter.judge.iteration.impact import Impact
    from oneiter.judge.iteration.results import CompareResult
    from oneiter.judge.iteration.verdict import decide

    plain = {"loss": 2.0, "loss_gap": loss_gap, "grad_gap": 1.0, "weight_gap": 1.0}
    every = {"loss_gap": 1 - every_share, "share": every_share, "grad_share": every_share, "weight_share": every_share}
    impact = Impact(tuple(fixes), plain, every if fixes else None, flagged or len(fixes), top, note)
    return decide(CompareResult("ref.h5", "tgt.h5", {}, {}, [], None, impact=impact))


def test_shares_that_do_not_add_up_say_the_fixes_interact():
    verdict = _verdict([_fix("a", 0.8), _fix("b", 0.7)], every_share=0.97)
    assert verdict.details[0].startswith("fix first: a@0 (forward output): fixing it closes 80 % of the loss gap "
                                         "(gradients 50 %, updated weights 50 %), the most of the 2 flagged calls")
    assert ("impact: the shares of the 2 fixes add up to 150 %, all of them together close 97 %: the fixes "
            "interact") in "\n".join(verdict.details)
    assert "interact" not in "\n".join(_verdict([_fix("a", 0.6), _fix("b", 0.38)], every_share=0.97).details)


def test_calls_not_fixed_come_last_and_are_named_with_why():
    verdict = _verdict([_fix("a", 0.2), _fix("b", 0.0, note="not fixed: it writes an input in place")],
                       flagged=9, top=2)
    lines = "\n".join(verdict.details)
    assert "impact: b@0 not fixed: it writes an input in place" in lines
    assert "impact: the 2 largest own errors of 9 flagged calls were fixed (--impact-top 2)" in lines


def test_a_loss_equal_bit_for_bit_ranks_by_the_gradients():
    from oneiter.judge.iteration.impact import Impact

    impact = Impact((_fix("b", 0.0, grad_share=0.9), _fix("a", 0.0, grad_share=0.3)), {"loss_gap": 0.0,
                    "grad_gap": 1.0, "weight_gap": 1.0}, None, 2, None)
    assert not impact.by_loss and impact.total == pytest.approx(1.2)
    verdict = _verdict([_fix("b", 0.0, grad_share=0.9)], loss_gap=0.0)
    assert verdict.details[0] == ("fix first: b@0 (forward output): the loss is the reference's bit for bit; fixing "
                                  "it closes 90 % of the gradients' gap (updated weights 90 %)")


def test_runs_that_do_not_reproduce_the_iteration_rank_nothing():
    verdict = _verdict([], note="not measured: the iteration run again from its start gives loss 2.5")
    assert not any(line.startswith("fix first") for line in verdict.details)
    assert "impact: not measured: the iteration run again from its start gives loss 2.5" in verdict.details


def test_a_saved_report_states_the_same_ranking():
    from oneiter.formatting import json_ready
    from oneiter.judge.iteration.verdict import Verdict

    verdict = _verdict([_fix("a", 0.8), _fix("b", 0.7)], every_share=0.97)
    again = Verdict.from_dict(json.loads(json.dumps(json_ready(verdict.as_dict()))))
    assert again.details == verdict.details and again.impact == verdict.impact


def test_shares_within_what_one_rounding_moves_are_not_told_apart():
    from dataclasses import replace

    verdict = _verdict([_fix("a", 0.5), _fix("b", 0.45)], every_share=0.95)
    impact = replace(verdict.impact, perturbed={"loss_gap": 0.9, "share": 0.1, "grad_share": 0.1,
                                                "weight_share": 0.1})
    from oneiter.judge.iteration.verdict import impact_lines

    lines = impact_lines(impact)
    assert lines[0].endswith("the most of the 2 flagged calls fixed one at a time (b@0 within one rounding's reach "
                             "of it: not told apart)")
    assert "impact: one rounding of the weights moves the loss gap by 10 %: shares closer than that are not told " \
           "apart" in lines
    chaotic = replace(impact, perturbed={**impact.perturbed, "share": -0.8})
    assert not chaotic.evidence
    lines = impact_lines(chaotic)
    assert not any(line.startswith("fix first") for line in lines)
    assert lines[0].startswith("impact: no ranking: one rounding of the weights moves the loss gap by 80 %, as far "
                               "as a fix does")
