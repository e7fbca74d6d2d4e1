"""The calibration never runs the kernel under test, and its noise estimates are themselves checked.

A tiny Hugging Face Llama recorded clean on the CPU in float32 is replayed on a stack whose float32 CPU kernel of
`aten::silu` (or only of `aten::silu_backward`) is 1e-3 off: a stand-in vendor plugin (`model_files/faulty_kernels.py`)
registered over torch's kernel with `torch.library`, knowing nothing of oneiter. The calibration's CPU reruns meet
that kernel too; they must find it (the dispatcher says where each kernel was registered) and run torch's own instead,
so the wrong kernel's error is never its own noise. A Python-level patch wrong only in float32 (faultkit's
`function_f32:silu`: nothing the dispatcher can see) makes the calibration itself return 1e-3 for a float32 SiLU:
far above what float32 can produce for an elementwise op, so that noise is not trusted, both figures are reported,
and the verdict is no match: the culprit where its error is above what float32 can produce, INCONCLUSIVE (exit 2)
where it is within (a patch wrong only in float64, the calibration's own run). With `--calibrate device` the
device's (here: the CPU's own, untrusted) noise is held to the trusted CPU's.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MODEL_FILES, compare_verdict, replay, replay_with_fault, run_cli

from oneiter.format.layout import IterationFile

pytest.importorskip("transformers")

LLAMA = str(MODEL_FILES / "hf_llama.py:build")
ACT = "model.layers.{}.mlp.act_fn"


@pytest.fixture(scope="module")
def llama(references):
    return references(LLAMA)


def _where(culprit: dict) -> tuple:
    return culprit["module"], culprit["call"], culprit["phase"], culprit["tensor"]


@pytest.mark.parametrize("kernel, expected", [
    ("silu", (ACT.format(0), 0, "forward", "output")),
    ("silu_backward", (ACT.format(1), 0, "backward", "grad_input.0")),  # backward runs layer 1 first
])
def test_a_wrong_cpu_kernel_is_the_culprit_not_its_own_noise(llama, plugin, kernel, expected, tmp_path):
    plugin.install(kernel)
    target = tmp_path / "target.h5"
    replay(llama, target)
    plugin.uninstall()
    code, verdict = compare_verdict(llama, target, tmp_path)
    culprit = verdict["culprit"]
    assert code == 1 and verdict["status"] == "diverged", verdict["headline"]
    assert _where(culprit) == expected
    # its own error is the kernel's 1e-3; its noise float32's on torch's kernel (about 1e-7), not 1e-3
    assert culprit["local_rel_l2"] == pytest.approx(1e-3, rel=1e-2)
    assert culprit["calibrated"] < 1e-6 and culprit["ratio"] > 1000
    assert (f"calibration: the CPU kernel of aten::{kernel} is not torch's own (registered at ") in "\n".join(
        verdict["warnings"])
    assert "faulty_kernels.py:" in verdict["warnings"][0]
    assert verdict["warnings"][0].endswith(f"the calibration ran torch's CPU kernel of "
                                           f"aten::{kernel}.{'out' if kernel == 'silu' else 'grad_input'} instead")
    with IterationFile(target) as f:
        assert f"aten::{kernel}" in f.local_attrs()["foreign_kernels"]


def test_a_calibration_of_1e3_for_a_float32_silu_is_not_trusted(llama, tmp_path, monkeypatch):
    target = tmp_path / "target.h5"
    replay_with_fault(llama, target, "function_f32:silu", monkeypatch)
    code, verdict = compare_verdict(llama, target, tmp_path)
    assert code == 1 and verdict["status"] == "diverged", verdict["headline"]  # never a match
    culprit = verdict["culprit"]
    assert _where(culprit) == (ACT.format(0), 0, "forward", "output")
    # both figures: the calibration's 1e-3 per side (float32 SiLU against float64 SiLU, a program that differs by
    # dtype) and what float32 can produce for it on the trusted path, about one unit roundoff per side
    assert culprit["calibrated"] == pytest.approx(2e-3, rel=1e-2)
    assert 2**-24 <= culprit["expected"] < 4 * 2**-24
    assert "its calibrated noise 2.00e-03 is not trusted" in verdict["headline"]
    untrusted = {(u["module"], u["phase"], u["tensor"]): u for u in verdict["untrusted"]}
    first = untrusted[(ACT.format(0), "forward", "output")]
    assert first["calibrated"] == culprit["calibrated"] and first["bound"] == pytest.approx(culprit["expected"])
    assert first["calibration"] == "cpu" and first["flagged"]
    line = next(d for d in verdict["details"] if d.startswith("calibration not trusted ("))
    assert f"{ACT.format(0)}@0 forward output: its calibrated noise 2.00e-03 is" in line
    assert "what its precision can produce for it (1." in line
    page = tmp_path / "report.html"
    res = run_cli("compare", llama, target, "--html", page)
    assert res.exit_code == 1 and "calibration not trusted (" in res.stdout
    assert "calibration not trusted (" in page.read_text()


def test_device_noise_beyond_the_trusted_cpus_is_a_finding_not_a_wider_band(llama, plugin, tmp_path):
    """`--calibrate device` on a device whose float32 SiLU is wrong and whose float64 one is right (the CPU with the
    plugin stands for it): the device's own noise is the kernel's 1e-3, the trusted CPU's about 1e-7."""
    plugin.install("silu")
    target = tmp_path / "target.h5"
    replay(llama, target, calibrate="device")
    plugin.uninstall()
    code, verdict = compare_verdict(llama, target, tmp_path)
    culprit = verdict["culprit"]
    assert code == 1 and _where(culprit) == (ACT.format(0), 0, "forward", "output"), verdict["headline"]
    assert culprit["calibrated"] > 1e-3 and culprit["expected"] < 1e-6
    device = [u for u in verdict["untrusted"] if u["module"] == ACT.format(0) and u["phase"] == "forward"]
    assert device and device[0]["calibration"] == "device"
    line = next(d for d in verdict["details"] if d.startswith("calibration not trusted ("))
    assert "the device's own noise 2.00e-03 for it is" in line and "the trusted CPU's (" in line


def test_an_untrusted_calibration_of_a_call_within_its_bound_is_inconclusive(llama, tmp_path, monkeypatch):
    """A Python-level SiLU (a plugin's patch, nothing the dispatcher sees) one float32 ulp off in float32, within what
    float32 can produce, and 1e-3 off in float64: the calibration's float64 run is wrong, its noise of 2e-3 is not
    trusted, and the call's own error, within its bound, clears nothing: no match, no culprit, exit 2."""
    original = torch.nn.functional.silu

    def silu(x, inplace=False):
        out = original(x, inplace=inplace)
        scale = {torch.float32: 1.0 + 2.0**-23, torch.float64: 1.0 + 1e-3}.get(out.dtype, 1.0)
        return out * scale

    monkeypatch.setattr(torch.nn.functional, "silu", silu)
    target = tmp_path / "target.h5"
    replay(llama, target)
    monkeypatch.setattr(torch.nn.functional, "silu", original)
    report = tmp_path / "report.json"
    res = run_cli("compare", llama, target, "--json", report)
    verdict = json.loads(report.read_text())["verdict"]
    assert res.exit_code == 2 and verdict["status"] == "inconclusive", res.output
    assert verdict["focus"] == "calibration not trusted" and verdict["num_flagged"] == 0
    assert verdict["headline"].startswith("INCONCLUSIVE: the calibration of ") and " is not trusted" in res.stdout
    first = {(u["module"], u["phase"], u["tensor"]): u for u in verdict["untrusted"]}[(ACT.format(0), "forward",
                                                                                       "output")]
    # both figures: the calibration's 1e-3 per side, and what float32 can produce for two roundings per side (the
    # SiLU and the scaling), a few unit roundoffs; its own error (about two) is within 4x that, so nothing is flagged
    assert first["calibrated"] == pytest.approx(2e-3, rel=1e-2) and 2**-24 <= first["bound"] < 8 * 2**-24
    assert first["expected"] == first["bound"] and 2**-24 < first["rel_l2"] <= 4 * first["bound"]
    assert not first["flagged"] and first["calibration"] == "cpu"
    assert f"{ACT.format(0)}@0 forward output: its calibrated noise 2.00e-03 is" in res.stdout
