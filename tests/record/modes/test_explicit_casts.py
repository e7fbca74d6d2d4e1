"""Low-precision dtypes used by explicit casts in a model's own code, outside any recipe: their rounding is noise.

`model_files/explicit_casts.py` computes a Linear in float16 by explicit `.half()` casts and makes an FP8 round trip
(`x.to(torch.float8_e4m3fn)`). The float64 rerun of the calibration keeps such casts in float64
(`record/modes/casts.py`), so the noise holds their rounding. Without that, the float64 run computed the float16
Linear in float16 too and its noise was float32's: a target whose float16 kernel is correct but rounds otherwise than
the CPU's (`model_files/half_kernels.py`, a stand-in for another device's) was a false culprit, 4.7x its noise.
"""

from __future__ import annotations

import sys

import pytest
from conftest import MODEL_FILES, record_small, replay, replay_with_fault

import oneiter

CASTS = str(MODEL_FILES / "explicit_casts.py:build")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("casts") / "ref.h5"
    record_small(out, CASTS, batch_size=16)
    return out


@pytest.fixture
def half_kernel():
    sys.path.insert(0, str(MODEL_FILES))
    import half_kernels

    half_kernels.install()
    yield half_kernels
    half_kernels.uninstall()
    sys.path.remove(str(MODEL_FILES))


def test_a_float16_kernel_that_rounds_otherwise_matches(ref, tmp_path, half_kernel):
    replay(ref, tmp_path / "t.h5")
    v = oneiter.compare(str(ref), str(tmp_path / "t.h5")).verdict_obj
    assert v.status == "match", v.headline
    assert not v.untrusted  # the noise holds the casts' rounding, and the bound the casts' roundoff: trusted
    local = {(r.module, r.phase, r.tensor): r for r in oneiter.compare(str(ref), str(tmp_path / "t.h5")).local}
    up = local[("up", "forward", "output")]
    assert 0 < up.rel_l2 and up.expected > 1e-5  # not bitwise the CPU's; float16's rounding is in the noise


@pytest.mark.parametrize("how", [{"amp": "bf16"}, {"dtype": "bfloat16"}])
def test_explicit_casts_under_a_lower_precision_match(ref, tmp_path, how):
    replay(ref, tmp_path / "t.h5", **how)
    v = oneiter.compare(str(ref), str(tmp_path / "t.h5")).verdict_obj
    assert v.status == "match" and not v.untrusted, v.headline


def test_an_error_after_the_casts_is_still_named(ref, tmp_path, monkeypatch):
    replay_with_fault(ref, tmp_path / "t.h5", "instance:down:1e-3", monkeypatch)
    c = oneiter.compare(str(ref), str(tmp_path / "t.h5")).culprit
    assert (c.module, c.phase, c.tensor) == ("down", "forward", "output")
