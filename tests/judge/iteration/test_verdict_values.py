"""The verdict is built from values: a row and a call's own tensor share one key, rows are settled into new rows
(the measured ones stay as measured), and the judge's result objects are built by keyword, never by position."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from oneiter.judge.iteration.entries import Key, LocalMetrics, LocalResult, Row
from oneiter.judge.iteration.findings import Finding
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.verdict import settled_rows
from oneiter.judge.measure.metrics import Metrics
from oneiter.judge.measure.tolerance import Tolerance

JUDGE = Path(__file__).resolve().parents[2] / "oneiter" / "judge"
# the result objects of judge/ (every report reads them): built by keyword, so a field added or moved cannot shift
# another's value
RESULTS = {"CompareResult", "Row", "LocalResult", "LocalMetrics", "Metrics", "Culprit", "Verdict", "RankedVerdict",
           "Impact", "Fix", "Judged", "RankedResult", "Suggestion", "StepsResult", "StepVerdict", "StepRow",
           "OpsResult", "TensorCheck", "ProgramTensor", "Departure", "Drill"}


def _metrics(rel_l2: float) -> Metrics:
    return Metrics(num_elements=8, max_abs=rel_l2, max_rel=rel_l2, rel_l2=rel_l2, cosine=1.0, num_out=8,
                   frac_out=1.0, need_atol=rel_l2, need_rtol=rel_l2, num_nan_ref=0, num_inf_ref=0, num_nan_target=0,
                   num_inf_target=0)


def _local(module: str, tensor: str, rel_l2: float, flagged: bool) -> LocalResult:
    m = LocalMetrics(num_elements=8, rel_l2=rel_l2, max_abs=rel_l2, cosine=1.0, num_nan_ref=0, num_inf_ref=0,
                     num_nan_target=0, num_inf_target=0, num_mismatch=0)
    return LocalResult(module=module, call=0, phase="forward", tensor=tensor, dtype="float32", seq=0, metrics=m,
                       calibrated=1e-6, calibration="", expected=1e-6, factor=4.0, flagged=flagged)


def test_a_row_and_the_local_result_of_its_tensor_share_one_key():
    row = Row(module="layer1.conv2", call=0, phase="forward", tensor="input.0", status="match")
    handed = _local("layer1", "layer1.conv2@0:input.0", 1e-7, False)  # what layer1's own code handed its child
    own = _local("layer1.conv2", "input.0", 1e-7, False)
    assert row.key == handed.row_key == own.key == Key("layer1.conv2", 0, "forward", "input.0")
    assert handed.key == Key("layer1", 0, "forward", "layer1.conv2@0:input.0") != handed.row_key
    assert isinstance(row.key, Key) and isinstance(handed.row_key, Key)
    # a file's entry names it by the plain tuple: the same key, in a dict too
    assert {("layer1.conv2", 0, "forward", "input.0"): 1}[row.key] == 1
    assert Key("m", 0, "optimizer", "weight").param_grad == ("m", 0, "param_grad", "weight")


def test_settled_rows_are_new_rows_and_the_measured_ones_stay_as_measured():
    tol = Tolerance(atol=1e-5, rtol=1.3e-6)
    rows = [Row(module=m, call=0, phase="forward", tensor="output", status="diverged", shape=(8,), dtype="float32",
                shape_target=(8,), dtype_target="float32", tolerance=tol, metrics=_metrics(0.1), reason="outside")
            for m in ("a", "b")]
    local = [_local("a", "output", 1e-7, False), _local("b", "output", 0.1, True)]
    evidence = CompareResult(reference="ref.h5", target="tgt.h5", meta_reference={}, meta_target={}, rows=rows,
                             first_divergence=0, local_kind="teacher_forced", local=local)
    settled = settled_rows(evidence, [Finding.of("culprit", 1, "its own error", local[1])])
    assert [r.status for r in settled] == ["drift", "diverged"]
    assert [r.status for r in rows] == ["diverged", "diverged"] and settled[0] is not rows[0]


def _positional(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in RESULTS and [a for a in node.args if not isinstance(a, ast.Starred)]:
                found.append((node.lineno, name))
    return found


def test_the_judges_result_objects_are_built_by_keyword():
    found = [f"{path.relative_to(JUDGE.parent.parent)}:{line} {name}" for path in sorted(JUDGE.rglob("*.py"))
             for line, name in _positional(ast.parse(path.read_text(encoding="utf-8")))]
    assert found == [], "built by position:\n" + "\n".join(found)
    # the check itself sees a positional construction
    assert _positional(ast.parse("Row('a', 0, 'forward', 'output', 'match')")) == [(1, "Row")]
    assert {f.name for f in fields(Row)} >= {"module", "call", "phase", "tensor"}
