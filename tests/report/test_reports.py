"""Tests for the looking-not-reading outputs of `oneiter compare`: report/html.py and report/tensorboard.py.

Recordings are synthetic (a chain root -> a -> b -> c written with `format.file_writer.FileWriter` in the recorder's
layout), so the tests need no torch and run in about a second. The HTML is checked through its embedded JSON and
its markup, the TensorBoard output by reading the event file back with tensorboard's own EventAccumulator.
"""

from __future__ import annotations

import copy
import json
import math
import re

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oneiter.format.file_writer import FileWriter
from oneiter.format.schema import CALLS, PARAM_GRADS, STATE_AFTER, call_key
from oneiter.judge.iteration.engine import compare_files
from oneiter.report.html import find_row, render_html, table_indices, verdict_lines, write_html
from oneiter.report.tensorboard import write_tensorboard
from oneiter.report.terminal import to_json

CHAIN = ["(root)", "a", "b", "c"]
PARAMS = ["a.weight", "b.weight", "c.weight", "scale"]  # `scale` belongs to the root module: no dot in its name


def chain_tensors(seed: int = 0) -> dict[tuple, np.ndarray]:
    """(module, phase, tensor) -> array for a 3-layer chain, plus parameter gradients and updated parameters."""
    rng = np.random.default_rng(seed)
    acts = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4)]
    grads = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4)]
    t = {("(root)", "forward", "input.0"): acts[0], ("(root)", "forward", "output"): acts[3],
         ("(root)", "backward", "grad_output"): grads[0], ("(root)", "backward", "grad_input.0"): grads[3]}
    for k, module in enumerate(CHAIN[1:]):
        t[(module, "forward", "input.0")], t[(module, "forward", "output")] = acts[k], acts[k + 1]
        t[(module, "backward", "grad_output")], t[(module, "backward", "grad_input.0")] = grads[2 - k], grads[3 - k]
    for name in PARAMS:
        t[("param", "param_grad", name)] = rng.standard_normal(8).astype(np.float32)
        t[("param", "optimizer", name)] = rng.standard_normal(8).astype(np.float32)
    t[("param", "optimizer", "steps")] = np.array([1], dtype=np.int64)  # a buffer judged exactly
    return t


def write_chain(path, tensors: dict[tuple, np.ndarray]):
    writer = FileWriter(path, {"model": "chain", "device": "cpu", "dtype": "float32"})
    for k, module in enumerate(CHAIN):  # capture order: the root's output and grad_input come last
        seq = (0, 7, 0, 7) if k == 0 else (2 * k - 1, 2 * k, 7 - 2 * k, 8 - 2 * k)
        writer.set_attrs(f"{CALLS}/{call_key(module, 0)}", {
            "module": "" if module == "(root)" else module, "call": 0, "exec_index": k, "class_name": "Chain",
            **dict(zip(("seq_input", "seq_output", "seq_grad_output", "seq_grad_input"), seq, strict=True)),
        })
    for (module, phase, name), array in tensors.items():
        if module == "param":
            writer.write(PARAM_GRADS if phase == "param_grad" else STATE_AFTER, name, array, str(array.dtype))
        else:
            writer.write(f"{CALLS}/{call_key(module, 0)}/{phase}", name, array, str(array.dtype))
    for group in (PARAM_GRADS, STATE_AFTER):
        names = PARAMS + (["steps"] if group == STATE_AFTER else [])
        writer.set_attrs(group, {"order": names})
    writer.finish({})
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A reference and a target that leaves tolerance at b's output; the root's `scale` gradient is off too, and
    c's output is zero in the reference but not in the target (rel_l2 = inf)."""
    folder = tmp_path_factory.mktemp("reports")
    ref_t, tgt_t = chain_tensors(), chain_tensors()
    ref_t[("c", "forward", "output")] = ref_t[("(root)", "forward", "output")] = np.zeros((4, 8), np.float32)
    tgt_t[("c", "forward", "output")] = tgt_t[("(root)", "forward", "output")] = np.full((4, 8), 1e-3, np.float32)
    for key in [("b", "forward", "output"), ("c", "forward", "input.0"), ("param", "param_grad", "scale")]:
        tgt_t[key] = tgt_t[key] + np.float32(1e-2)
    return write_chain(folder / "ref.h5", ref_t), write_chain(folder / "tgt.h5", tgt_t)


@pytest.fixture(scope="module")
def result(pair):
    return compare_files(*pair)


def with_local(doc: dict, culprit: str = "c") -> dict:
    """The coming contract: rows carry `local`, the verdict a `culprit` (here: `culprit`'s forward output)."""
    doc = copy.deepcopy(doc)
    for row in doc["rows"]:
        if row["phase"] == "forward" and row["tensor"] == "output" and row["module"] != "(root)":
            bad = row["module"] == culprit
            row["local"] = {"rel_l2": 5e-2 if bad else 1e-7, "expected": 1e-6, "ratio": 5e4 if bad else 0.1,
                            "flagged": bad}
    doc["verdict"]["culprit"] = {"module": culprit, "call": 0, "phase": "forward", "tensor": "output",
                                 "local_rel_l2": 5e-2, "expected": 1e-6, "ratio": 5e4}
    doc["verdict"]["nan_origin"] = None
    return doc


def embedded(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="oneiter-data">(.*?)</script>', page, re.S)
    assert match, "no embedded data block"
    return json.loads(match.group(1))


# -- HTML -----------------------------------------------------------------------------------------------------------
def test_html_embeds_the_full_json_and_the_verdict(result, tmp_path):
    path = write_html(to_json(result), tmp_path / "report.html")
    page = path.read_text(encoding="utf-8")
    assert embedded(page) == to_json(result)
    assert "DIVERGED at b@0 forward output" in page
    assert "class='banner diverged'" in page
    assert '<svg id="error-plot"' in page and 'id="first-divergence-marker"' in page
    assert 'id="tolerance-line"' in page
    assert "c@0 forward output" in page  # the inf row is in the table
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<link|<img|@import|url\(", page, re.I)


def test_html_marks_the_culprit_and_local_error(result):
    doc = with_local(to_json(result))
    page = render_html(doc)
    assert embedded(page) == doc
    assert 'id="culprit-marker"' in page
    culprit = find_row(doc, doc["verdict"]["culprit"])
    assert f"culprit #{culprit}: c@0 forward output" in page  # later than the first divergence, at b
    assert "Culprit: c@0 forward output" in page and "50000.0x its expected noise" in page
    assert "<th title='sort'>local rel_l2</th>" in page
    assert "class='s-diverged culprit flagged'" in page


def test_html_escapes_names_from_the_recording(result):
    doc = to_json(result)
    doc["rows"][0]["module"] = hostile = "</script><script>alert('x')</script>&\udcff"
    doc["verdict"]["module"] = hostile
    page = render_html(doc)
    assert "<script>alert" not in page
    assert "&lt;/script&gt;&lt;script&gt;alert(&#x27;x&#x27;)" in page
    assert embedded(page)["rows"][0]["module"] == hostile


def test_html_of_a_match(pair, tmp_path):
    result = compare_files(pair[0], pair[0])
    page = write_html(result, tmp_path / "match.html").read_text(encoding="utf-8")
    assert "class='banner match'" in page and "MATCH: all" in page
    assert "first-divergence-marker" not in page and "culprit-marker" not in page
    assert embedded(page) == to_json(result)


def test_table_window_keeps_the_divergence_and_the_culprit(result):
    doc = to_json(result)
    doc["rows"] = [dict(doc["rows"][0], index=i, module=f"m{i}") for i in range(1000)]
    for i in (300, 900):
        doc["rows"][i]["status"] = "diverged"
    doc["verdict"].update(module="m300", call=0, phase="forward", tensor="input.0")
    doc["verdict"]["culprit"] = {"module": "m900", "call": 0, "phase": "forward", "tensor": "input.0"}
    indices, note = table_indices(doc)
    assert indices[0] == 280 and 479 in indices and 900 in indices and 500 not in indices
    assert note == "211 of 1000 rows around the first divergence (#300) and the culprit (#900)"
    page = render_html(doc)
    assert page.count("<tr class='s-") == len(indices)


def test_verdict_lines_tolerate_a_document_without_local_data(result):
    doc = to_json(result)
    assert doc["verdict"]["culprit"] is None
    lines = verdict_lines(doc)
    assert lines[0] == "DIVERGED at b@0 forward output" and not any("ulprit" in line for line in lines)
    doc["verdict"]["culprit"] = None
    assert not any("ulprit" in line for line in verdict_lines(doc))  # no local data: no claim either way


# -- TensorBoard ----------------------------------------------------------------------------------------------------
def read_back(event_file):
    acc = EventAccumulator(str(event_file.parent), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_curves_equal_the_json_rows(result, pair, tmp_path):
    event_file = write_tensorboard(result, tmp_path / "tb", *pair)
    assert event_file.is_file() and event_file.parent == tmp_path / "tb"
    acc, doc = read_back(event_file), to_json(result)
    phases = sorted({r["phase"] for r in doc["rows"]})
    assert sorted(t for t in acc.Tags()["scalars"]) == sorted(f"rel_l2/{p}" for p in phases)
    for phase in phases:
        rows = [r for r in doc["rows"] if r["phase"] == phase and r["rel_l2"] is not None]
        events = acc.Scalars(f"rel_l2/{phase}")
        assert [e.step for e in events] == [r["index"] for r in rows]
        for event, row in zip(events, rows, strict=True):
            assert event.value == pytest.approx(float(row["rel_l2"]), rel=1e-6)  # stored as float32
    assert any(math.isinf(e.value) for e in acc.Scalars("rel_l2/forward"))  # c's output: reference all zero
    text = acc.Tensors("verdict")[0].tensor_proto.string_val[0].decode()
    assert "DIVERGED at b@0 forward output" in text
    # each step is named: the scalars' x axis is the row number, the `entries` table says which entry it is
    entries = acc.Tensors("entries")[0].tensor_proto.string_val[0].decode().splitlines()
    assert entries[:2] == ["| step | entry | status |", "|---:|---|---|"] and len(entries) == len(doc["rows"]) + 2
    for line, row in zip(entries[2:], doc["rows"], strict=True):
        assert line == f"| {row['index']} | `{row['module']}@{row['call']} {row['phase']} {row['tensor']}` | " \
                       f"{row['status']} |"


def test_tensorboard_histograms_of_divergent_rows(result, pair, tmp_path):
    event_file = write_tensorboard(result, tmp_path / "tb", *pair, max_histograms=100)
    acc, doc = read_back(event_file), to_json(result)
    tags = acc.Tags()["histograms"]
    assert "error/b@0/forward/output" in tags
    assert "error/c@0/forward/input.0" in tags
    assert "error/(root)@0/param_grad/scale" in tags  # a root-level parameter maps to param_grads/scale
    assert all(t.startswith("error/") for t in tags)
    histo = acc.Histograms("error/b@0/forward/output")[0]
    assert histo.step == find_row(doc, {"module": "b", "call": 0, "phase": "forward", "tensor": "output"})
    assert histo.histogram_value.num == 32
    assert histo.histogram_value.min == pytest.approx(1e-2, rel=1e-3)
    diverged = [r for r in doc["rows"] if r["status"] == "diverged"]
    assert len(tags) <= len(diverged)


def test_tensorboard_local_curves_and_culprit_first(result, pair, tmp_path):
    doc = with_local(to_json(result))
    event_file = write_tensorboard(doc, tmp_path / "tb", *pair, max_histograms=1)
    acc = read_back(event_file)
    scalars = acc.Tags()["scalars"]
    for tag in ("local_rel_l2/forward", "expected_noise/forward", "local_ratio/forward"):
        assert tag in scalars
    local_rows = [r for r in doc["rows"] if r.get("local")]
    events = acc.Scalars("local_rel_l2/forward")
    assert [e.step for e in events] == [r["index"] for r in local_rows]
    assert [e.value for e in events] == pytest.approx([r["local"]["rel_l2"] for r in local_rows], rel=1e-6)
    assert acc.Tags()["histograms"] == ["error/c@0/forward/output"]  # the culprit comes first


def test_tensorboard_warns_when_the_folder_already_has_a_run(result, pair, tmp_path):
    write_tensorboard(result, tmp_path / "tb", *pair, max_histograms=0)
    with pytest.warns(UserWarning, match="already holds event files"):
        write_tensorboard(result, tmp_path / "tb", *pair, max_histograms=0)
