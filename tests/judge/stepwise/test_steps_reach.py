"""Where the band stops being evidence: a run that amplifies its roundings (an MLP trained with a learning rate far
too large, `model_files/chaotic.py`) parts from a run one rounding apart within a few steps. Those steps are not
judged, and the verdict is inconclusive from the first of them — never a match."""

from __future__ import annotations

import json

from conftest import MODEL_FILES, run_cli

from oneiter.judge.stepwise.step_compare import DECORRELATED

SPEC = f"{MODEL_FILES / 'chaotic.py'}:build"


def test_steps_the_band_cannot_judge_make_the_verdict_inconclusive(tmp_path):
    ref, tgt, report = tmp_path / "ref.h5", tmp_path / "tgt.h5", tmp_path / "report.json"
    res = run_cli("record", "-m", SPEC, "--model-arg", "lr=8", "-b", "8", "--steps", "8", "-o", ref, "-q")
    assert res.exit_code == 0
    assert run_cli("record", "--replay", ref, "-m", SPEC, "--amp", "bf16", "-o", tgt, "-q").exit_code == 0
    res = run_cli("compare", ref, tgt, "--json", report)
    doc = json.loads(report.read_text())
    verdict, steps = doc["verdict"], doc["steps"]
    assert (res.exit_code, verdict["status"], verdict["step"]) == (2, "inconclusive", None)
    assert [s["status"] for s in steps] == ["within band"] * 4 + ["not judged"] * 4
    assert all(s["ratio"] < 0.25 for s in steps[:4])  # judged, and well inside
    assert steps[4]["band"] > DECORRELATED and steps[3]["groups"]["gradients"]["band"] <= DECORRELATED
    assert verdict["headline"].startswith("INCONCLUSIVE from step 4: steps 0-3 within the band, then the band "
                                          f"exceeds {DECORRELATED:g}: runs one rounding apart drift ")
    ref_cmd, tgt_cmd = verdict["commands"]  # a later step judged on its own: recorded in full on both sides
    assert "--step 4" in ref_cmd and "--replay" in tgt_cmd and "--amp bf16" in tgt_cmd
    assert ref_cmd in res.stdout and "MATCH" not in res.stdout
