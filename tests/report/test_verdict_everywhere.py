"""One verdict, five writers: the terminal report, JSON, CSV, HTML and TensorBoard of one comparison state
the same status, culprit and first divergence, in the same words.

Real recordings of a small ResNet-18 (the float32 CPU reference of conftest) and three replays made with the CLI:
bf16 autocast (accumulated drift everywhere, no call to blame: a match), bf16 with a 5 % forward fault in
`layer3.1.conv2` (the culprit, far after the first divergence) and float32 with an Inf injected into
`layer2.1.conv1`'s output (a culprit by NaN/Inf, where every value metric of the finite elements is 0).
"""

from __future__ import annotations

import csv
import dataclasses
import html
import json
import re

import pytest
from conftest import run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.findings import PRIORITY
from oneiter.judge.iteration.verdict import FOCUS, decide
from oneiter.report.html import render_html

FAULT, INF = "layer3.1.conv2", "layer2.1.conv1"
REPLAYS = {  # `record --replay ref.h5 --amp bf16 [--inject-fault ...]`, as `replay`'s keywords
    "bf16": {"amp": "bf16"},
    "fault": {"amp": "bf16", "faults": [f"{FAULT}:forward=0.05"]},
    "inf": {"faults": [f"{INF}:inf"]},
}


@pytest.fixture(scope="module")
def outputs(references, replays, tmp_path_factory):
    """case -> what each writer wrote for that comparison: terminal text, JSON, CSV rows, HTML page, TB text (the
    replays shared with the tests that judge the same ones, e.g. tests/judge/iteration/test_blame.py)."""
    ref, made = references("resnet18"), {}
    for case, options in REPLAYS.items():
        folder = tmp_path_factory.mktemp(case)
        tgt = replays("resnet18", **options)
        res = run_cli("compare", ref, tgt, "--json", folder / "r.json", "--csv", folder / "r.csv",
                      "--html", folder / "r.html", "--tensorboard", folder / "tb")
        assert res.exit_code == (0 if case == "bf16" else 1), res.output
        with open(folder / "r.csv", newline="") as fh:
            table = list(csv.reader(fh))
        made[case] = {
            "code": res.exit_code, "terminal": res.stdout, "json": json.loads((folder / "r.json").read_text()),
            "csv_header": table[0], "csv": [dict(zip(table[0], line, strict=True)) for line in table[1:]],
            "html": (folder / "r.html").read_text(encoding="utf-8"), "tb": _tb_text(folder / "tb"),
            "ref": ref, "tgt": tgt,
        }
    return made


def _tb_text(folder) -> str:
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors("verdict")[0].tensor_proto.string_val[0].decode()


def row_index(doc: dict, module: str, phase: str, tensor: str) -> int:
    return next(r["index"] for r in doc["rows"] if (r["module"], r["call"], r["phase"], r["tensor"]) == (
        module, 0, phase, tensor))


# -- what each writer states ----------------------------------------------------------------------------------------
def terminal_lines(out: dict) -> list[str]:
    """The verdict's lines of the terminal report: everything above the `reference` line."""
    lines = out["terminal"].splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("reference "))]


def html_lines(out: dict) -> list[str]:
    """The banner: the title (h1) and its reason (p.reason) make the headline; one paragraph per detail."""
    banner = re.search(r"<header class='banner \w+' id='verdict'>(.*?)</header>", out["html"], re.S)[1]
    title = html.unescape(re.search(r"<h1>(.*?)</h1>", banner)[1])
    reason = re.search(r"<p class='reason'>(.*?)</p>", banner)
    details = [html.unescape(p) for p in re.findall(r"<p class='(?:key)?'>(.*?)</p>", banner)]
    return [f"{title}: {html.unescape(reason[1])}" if reason else title, *details]


def tb_lines(out: dict) -> list[str]:
    """The TensorBoard text: the headline (its title in bold), one paragraph a detail, then the two runs."""
    headline, *details, _runs = out["tb"].split("\n\n")
    return [headline.replace("**", "", 2), *details]


def stated(lines: list[str]) -> dict:
    """Status, culprit (module, phase, row) and first divergence (row) as the verdict's sentences state them."""
    text = "\n".join(lines)
    culprit = re.search(r"[Cc]ulprit:? (\S+)@\d+ (\w+) \S+ \(#(\d+)\)", text)
    first = re.search(r"first divergence(?: in causal order,|:) #(\d+)", text)
    return {"status": lines[0].split(":")[0].split(" ")[0].lower(),
            "culprit": culprit and (culprit[1], culprit[2], int(culprit[3])), "first": first and int(first[1])}


def stated_by_json(doc: dict) -> dict:
    v = doc["verdict"]
    c = v["culprit"]
    return {"status": v["status"], "culprit": c and (c["module"], c["phase"], c["index"]),
            "first": v["first_divergence"] and v["first_divergence"]["index"]}


def stated_by_csv(rows: list[dict]) -> dict:
    """The `role` column marks the verdict's entry, the culprit and the first divergence."""
    roles = {role: r for r in rows for role in r["role"].split()}
    c = roles.get("culprit")
    return {"status": "diverged" if "verdict" in roles else "match",
            "culprit": c and (c["module"], c["phase"], int(c["index"])),
            "first": int(roles["first_divergence"]["index"]) if "first_divergence" in roles else None}


def stated_by_html_plot(page: str, status: str) -> dict:
    culprit = re.search(r'class="mark">culprit #(\d+): (\S+)@\d+ (\w+) ', page)
    first = re.search(r'class="mark">first divergence #(\d+)<', page)
    return {"status": status, "culprit": culprit and (culprit[2], culprit[3], int(culprit[1])),
            "first": first and int(first[1])}


EXPECTED = {  # case -> (status, culprit module and phase, or None)
    "bf16": ("match", None),
    "fault": ("diverged", (FAULT, "forward")),
    "inf": ("diverged", (INF, "forward")),
}


@pytest.mark.parametrize("case", list(REPLAYS))
def test_five_writers_state_one_verdict(case, outputs):
    out = outputs[case]
    doc = out["json"]
    status, culprit = EXPECTED[case]
    first = row_index(doc, "conv1", "forward", "output") if case != "inf" else row_index(doc, INF, "forward", "output")
    expected = {"status": status, "first": first,
                "culprit": culprit and (*culprit, row_index(doc, culprit[0], "forward", "output"))}
    banner_status = re.search(r"<header class='banner (\w+)'", out["html"])[1]
    lines = terminal_lines(out)
    assert lines == html_lines(out) == tb_lines(out) == [doc["verdict"]["headline"], *doc["verdict"]["details"]]
    assert stated(lines) == expected
    assert stated_by_json(doc) == expected
    assert stated_by_csv(out["csv"]) == expected
    assert stated_by_html_plot(out["html"], banner_status) == expected
    assert out["code"] == {"match": 0, "diverged": 1}[status]
    if culprit:  # the terminal's `>` row, the JSON's verdict index and the culprit are one row
        focus = next(line for line in out["terminal"].splitlines() if line.lstrip().startswith(">"))
        assert focus.split()[0] == f">{expected['culprit'][2]}" == f">{doc['verdict']['index']}"


@pytest.mark.parametrize("case", list(REPLAYS))
def test_the_json_verdict_lists_its_findings(case, outputs):
    """`verdict.findings`: every finding the verdict chose among, in the shape two multi-step recordings' verdict
    has too (tests/judge/stepwise/test_steps.py); the strongest is the one it names."""
    verdict = outputs[case]["json"]["verdict"]
    found = verdict["findings"]
    assert all(set(f) == {"kind", "priority", "entry", "reason"} and f["priority"] == PRIORITY[f["kind"]]
               for f in found)
    if case == "bf16":  # a match rests on no finding
        assert found == [] and verdict["focus"] is None
        return
    top = max(found, key=lambda f: f["priority"])
    assert top == found[0] and (top["kind"], top["entry"]) == ("culprit", verdict["index"]) and verdict["focus"] == \
        FOCUS["culprit"]
    assert top["reason"] == verdict["culprit"]["reason"]


def test_a_match_on_local_data_says_what_it_rests_on(outputs):
    out, doc = outputs["bf16"], outputs["bf16"]["json"]
    v = doc["verdict"]
    assert v["num_drift"] > 400 and v["num_diverged"] == 0
    assert v["num_matched"] + v["num_drift"] + v["num_rounding"] == v["num_entries"]
    assert doc["counts"]["drift"] == v["num_drift"] and doc["counts"]["diverged"] == 0
    # the first conv's output, computed from the batch (bitwise the reference's), is its own rounding, not drift,
    # and so is the same tensor as the next call's input
    assert doc["counts"]["rounding"] == v["num_rounding"] > 0
    first = v["first_divergence"]["index"]
    pair = [(r["module"], r["tensor"]) for r in doc["rows"][first:first + 2]]
    assert pair == [("conv1", "output"), ("bn1", "input.0")]
    assert doc["rows"][first]["status"] == doc["rows"][first + 1]["status"] == "rounding"
    assert (f"{v['num_rounding']} are outside tolerance from values bitwise the reference's: their own call's "
            f"rounding, within its noise") in v["headline"]
    title = "MATCH: no call's own error exceeds its expected noise x4"
    assert v["headline"].startswith(title + ": ")
    assert (f"{v['num_drift']} of {v['num_entries']} entries are outside tolerance: accumulated drift, which this "
            f"verdict does not rest on") in v["headline"]
    for text in (out["terminal"], out["html"], out["tb"]):
        assert title in text and "within tolerance (largest" not in text  # never "all N entries within tolerance"
    counts = f"{v['num_matched']} match, {v['num_rounding']} rounding, {v['num_drift']} drift"
    assert f"{len(doc['rows'])} entries: {counts}" in out["html"]
    assert f"entries   {len(doc['rows'])}: {counts}" in out["terminal"]


def test_culprit_and_first_divergence_are_labelled_apart(outputs):
    out, doc = outputs["fault"], outputs["fault"]["json"]
    culprit, first = doc["verdict"]["culprit"]["index"], doc["verdict"]["first_divergence"]["index"]
    assert first < culprit
    assert f"culprit #{culprit}: {FAULT}@0 forward output" in out["html"]
    assert f"first divergence #{first}<" in out["html"] and f"first divergence #{culprit}" not in out["html"]
    assert f"rows {culprit - 5}-{culprit + 10} of {len(doc['rows'])} around the culprit" in out["terminal"]
    assert f"of {len(doc['rows'])} rows around the culprit (#{culprit})" in out["html"]
    assert doc["rows"][first]["role"] == "first_divergence" and doc["rows"][culprit]["role"] == "verdict culprit"


@pytest.mark.parametrize("case", list(REPLAYS))
def test_a_row_status_never_contradicts_its_flag(case, outputs, tmp_path):
    out, doc = outputs[case], outputs[case]["json"]
    flagged = []
    for row, line in zip(doc["rows"], out["csv"], strict=True):
        assert line["status"] == row["status"]
        local = row["local"]
        if local and local["flagged"]:
            flagged.append((row["module"], row["phase"]))
            assert row["status"] == "diverged", row
        elif row["status"] == "diverged":  # not flagged: only NaN/Inf that differ make it a divergence here
            assert (row["num_nan_ref"], row["num_inf_ref"]) != (row["num_nan_target"], row["num_inf_target"]), row
        elif row["status"] == "drift":
            assert row["num_out"] > 0, row
        elif row["status"] == "rounding":  # its own error, within noise, from values bitwise the reference's
            assert row["num_out"] > 0 and not (local and local["flagged"]), row
        else:
            assert row["status"] == "match" and row["num_out"] == 0, row
    # the culprit's own forward, backward and weight gradient; its containers' own code is within noise
    layer = {"fault": FAULT, "inf": INF}.get(case)
    assert flagged == ([] if layer is None else [(layer, "forward"), (layer, "backward"), (layer, "param_grad")])
    # the same in the terminal table: a flagged ratio (`!`) only beside `diverged`
    res = run_cli("compare", out["ref"], out["tgt"], "--all")
    table = [line.split() for line in res.stdout.splitlines() if re.match(r"\s*>?\d+\s", line)]
    assert len(table) == len(doc["rows"])
    for cells, row in zip(table, doc["rows"], strict=True):
        assert cells[4] == row["status"]  # after #, module@call, phase, tensor
        assert any(c.endswith("x!") for c in cells) == bool(row["local"] and row["local"]["flagged"]), cells


def test_an_inf_row_shows_its_inf_count_first(outputs):
    out, doc = outputs["inf"], outputs["inf"]["json"]
    i = row_index(doc, INF, "forward", "output")
    row = doc["rows"][i]
    assert (row["status"], row["nan_inf"], row["max_abs"], row["rel_l2"]) == ("diverged", "Inf 0|1", 0.0, 0.0)
    assert row["local"]["ratio"] == "inf" and row["local"]["flagged"]  # not a clean-looking 0.0x
    # CSV: the NaN/Inf column comes before every metric
    header = out["csv_header"]
    assert header.index("nan_inf") == header.index("status") + 2 < header.index("max_abs")
    assert out["csv"][i]["nan_inf"] == "Inf 0|1"
    # terminal: right after the status, before max_abs; the local ratio reads inf, flagged
    line = next(line for line in out["terminal"].splitlines() if line.lstrip().startswith(f">{i} "))
    assert re.search(rf">{i}\s+{re.escape(INF)}@0 forward output\s+diverged\s+Inf 0\|1\s+0\.00e\+00", line)
    assert "infx!" in line
    # HTML: the cell after the status
    tr = re.search(rf"<tr class='[^']*' data-name='{re.escape(INF)}@0 forward output'[^>]*>(.*?)</tr>", out["html"])
    cells = re.findall(r"<td[^>]*>(.*?)</td>", tr[1])
    assert cells[2:4] == ["diverged", "Inf 0|1"]
    assert doc["verdict"]["headline"] == (f"DIVERGED: culprit {INF}@0 forward output (#{i}): 1 NaN/Inf at other "
                                          f"positions (or with another sign) than in the reference, given the same "
                                          f"inputs")


def test_local_data_with_no_local_result_is_inconclusive_not_a_match(outputs):
    out = outputs["bf16"]
    result = compare_files(out["ref"], out["tgt"])
    assert result.status == "match" and result.exit_code == 0
    empty = dataclasses.replace(result, local=[], findings=[], chain=[])
    verdict = decide(empty)
    assert (verdict.status, verdict.exit_code) == ("inconclusive", 2)
    assert verdict.headline.startswith("INCONCLUSIVE: no call's own error could be measured: ")
    assert "class='banner inconclusive'" in render_html(empty)


def test_the_public_api_reads_the_same_verdict(outputs):
    import oneiter

    out = outputs["fault"]
    result = oneiter.compare(out["ref"], out["tgt"])
    doc = out["json"]
    assert (result.culprit.module, result.culprit.phase, result.culprit.index) == (
        FAULT, "forward", doc["verdict"]["culprit"]["index"])
    assert result.exit_code == 1 and result.verdict() == result.verdict_obj.as_dict()
    assert json.loads(json.dumps(result.to_json())) == doc


def test_the_csv_says_why_a_row_is_diverged(outputs):
    rows, doc = outputs["fault"]["csv"], outputs["fault"]["json"]
    header = outputs["fault"]["csv_header"]
    assert header[header.index("nan_inf") + 1:header.index("nan_inf") + 6] == [
        "local_rel_l2", "expected_noise", "ratio", "flagged", "basis"]
    culprit = rows[doc["verdict"]["culprit"]["index"]]
    local = doc["rows"][int(culprit["index"])]["local"]
    assert (culprit["status"], culprit["basis"], culprit["flagged"]) == ("diverged", "local_error", "1")
    assert float(culprit["local_rel_l2"]) == local["rel_l2"] and float(culprit["expected_noise"]) == local["expected"]
    assert float(culprit["ratio"]) == pytest.approx(local["rel_l2"] / local["expected"]) and float(culprit["ratio"]) > 4
    drift = next(r for r in rows if r["status"] == "drift" and r["basis"] == "local_error")
    assert float(drift["ratio"]) <= 4 and drift["flagged"] == "0"  # outside tolerance, within its own noise
    unprobed = next(r for r in rows if r["local_rel_l2"] == "")
    assert unprobed["basis"] == "tolerance" and unprobed["ratio"] == unprobed["expected_noise"] == ""


def _attr_rows(page: str) -> list[dict]:
    rows = [dict(re.findall(r"data-(\w+)='([^']*)'", tr)) for tr in re.findall(r"<tr class='[^']*'[^>]*>", page)]
    return [r for r in rows if "name" in r]  # not the `... N rows` gaps


@pytest.mark.parametrize("case", list(REPLAYS))
def test_html_divergent_only_shows_flagged_rows_and_says_how_many(case, outputs):
    page, doc = outputs[case]["html"], outputs[case]["json"]
    flagged = [r for r in doc["rows"] if r["status"] == "diverged" or (r["local"] or {}).get("flagged")]
    count = int(re.search(r"<span id='divergent-count'>(\d+)</span> of (\d+) rows flagged", page)[1])
    assert count == len(flagged) and count == {"bf16": 0, "fault": 3, "inf": len(flagged)}[case]
    shown = _attr_rows(page)
    assert {r["status"] for r in shown if r["divergent"] == "1"} <= {"diverged"}
    assert {r["status"] for r in shown if r["divergent"] == "0"} <= {"match", "drift", "rounding"}
    if case == "bf16":  # drift rows (hundreds) are not "divergent": the box hides them
        assert sum(r["divergent"] == "0" and r["status"] == "drift" for r in shown) > 100
    # the script filters on the same attribute, and marks rows the same way when it shows all of them
    assert "only.checked&&tr.dataset.divergent!=='1'" in page
    assert 'var NOT_DIVERGENT=["match", "rounding", "drift", "not_judged"];' in page
    assert "NOT_DIVERGENT.indexOf(r.status)<0||(r.local&&r.local.flagged)" in page


def test_html_plot_bands_noise_marks_every_flagged_point_and_draws_flat_tolerances(outputs):
    page = outputs["bf16"]["html"]
    svg = re.search(r"<svg id=\"error-plot\".*?</svg>", page, re.S)[0]
    assert '<path id="noise-band"' in svg and "expected noise" not in re.sub(r"<title>.*?</title>", "", svg)
    tolerance = re.search(r'<g id="tolerance-line">(.*?)</g></g>', svg, re.S)[0]
    lines = re.findall(r'<line x1="[\d.]+" x2="[\d.]+" y1="([\d.]+)" y2="([\d.]+)"', tolerance)
    assert len(lines) == 2 and all(a == b for a, b in lines)  # one flat line per rtol: float32, and bf16 rows
    assert "rtol 1.3e-06 (float32)" in tolerance and "rtol 1.6e-02 (float32|bfloat16)" in tolerance
    # both dtypes in the table's dtype column
    assert "<td>float32|bfloat16</td>" in page
    fault_svg = outputs["fault"]["html"]
    flagged = sum(bool((r["local"] or {}).get("flagged")) for r in outputs["fault"]["json"]["rows"])
    assert fault_svg.count('class="flagged-mark"') == flagged == 3


def test_html_layout_holds_at_800_px(outputs):
    """The table scrolls sideways in its own box and no number or name wraps (checked in a real browser by
    tools/report_screenshots.py: screenshots at 1400 and 800 px)."""
    page = outputs["fault"]["html"]
    css = re.search(r"<style>(.*?)</style>", page, re.S)[1]
    assert "#rows td{white-space:nowrap}" in css and ".scroll{overflow-x:auto;max-width:100%}" in css
    assert "word-break:break-all" not in css
    assert "<div class='scroll'><table id='rows'" in page and "<div class='scroll'><table class='runs'>" in page
    assert re.search(r'<svg id="error-plot" viewBox="0 0 \d+ \d+" width="100%"', page)  # the plot scales down
