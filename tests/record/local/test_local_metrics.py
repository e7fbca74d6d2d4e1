"""The numbers of a local-error row (`record/local/rerun.py tensor_stats`, `rel_l2`): the C kernel's one pass
(`format.stats.pair_sums`) against torch's reductions and a float64 computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import NEEDS_STATS_KERNEL

from oneiter.format import stats
from oneiter.record.local.rerun import rel_l2, tensor_stats


def _exact(a, b) -> tuple:
    a, b = a.double(), b.double()
    d = a - b
    return ((a * a).sum().item(), (b * b).sum().item(), (d * d).sum().item(), (a * b).sum().item(),
            d.abs().max().item())


@NEEDS_STATS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_sums_are_the_float64_sums_on_both_paths(dtype):
    """AVX2 and the portable loops: every sum as a float64 computation's (to summation order), the max exactly;
    lengths that end mid-vector and an odd start; anything the kernel does not take is None (torch then)."""
    kernel, kinds = stats.KERNEL.load()
    base = torch.randn(3 * 4096 + 5, dtype=torch.float64)
    for a, b in ((base.to(dtype), (base + 1e-3 * torch.randn_like(base)).to(dtype)),
                 (base[1:].to(dtype), base[:-1].to(dtype))):
        want = _exact(a, b)
        fast = stats.pair_sums(a, b)
        slow = kernel.pair(a.data_ptr(), b.data_ptr(), a.numel(), kinds[dtype], False)
        for got in (fast, slow):
            np.testing.assert_allclose(got[:4], want[:4], rtol=1e-12)
            assert got[4] == want[4]
    a = torch.randn(64, dtype=dtype)
    assert stats.pair_sums(a, a) == pytest.approx(((a.double() ** 2).sum().item(),) * 2 + (0.0,) +
                                                  ((a.double() ** 2).sum().item(), 0.0), rel=1e-12)
    nan = a.clone()
    nan[17] = float("nan")
    assert not math.isfinite(stats.pair_sums(a, nan)[2])  # the caller's careful path
    assert stats.pair_sums(a.bfloat16(), a.bfloat16()) is None
    assert stats.pair_sums(a[::2], a[1::2]) is None  # not contiguous
    assert stats.pair_sums(a.float(), a.double()) is None


@NEEDS_STATS_KERNEL
@pytest.mark.parametrize("case", ["close", "equal", "far", "nan", "bfloat16"])
def test_a_row_is_the_same_with_and_without_the_kernel(case, monkeypatch):
    """tensor_stats and rel_l2 with the kernel are the float64 results (torch's reductions, accumulating in
    float32, are within 1e-4 of them); equal tensors give exactly rel_l2 0 and cosine 1; NaN is judged by
    position either way (both take the float64 careful path); and the kernel is what runs on the CPU."""
    torch.manual_seed(0)
    ref = torch.randn(8, 64, 29, 29)
    value = {"close": ref + 1e-5 * torch.randn_like(ref), "equal": ref.clone(), "far": torch.randn_like(ref),
             "nan": ref.clone(), "bfloat16": (ref * 1.01).bfloat16()}[case]
    if case == "nan":
        value.view(-1)[12345] = float("nan")
    if case == "bfloat16":
        ref = ref.bfloat16()
    calls = []
    kernel, kinds = stats.KERNEL.load()
    spy = type("Spy", (), {"pair": staticmethod(lambda *a: calls.append(a[3]) or kernel.pair(*a))})()
    monkeypatch.setattr(stats.KERNEL, "_loaded", (spy, kinds))
    with_kernel, rel_kernel = tensor_stats(ref, value), rel_l2(ref, value)
    assert calls == [0, 0]  # float32 (bfloat16 pairs are judged in float32)
    monkeypatch.setattr(stats.KERNEL, "use", False)
    with_torch, rel_torch = tensor_stats(ref, value), rel_l2(ref, value)
    assert len(calls) == 2
    assert with_kernel.keys() == with_torch.keys()
    for key in ("numel", "nan_ref", "inf_ref", "nan", "inf", "mismatch"):
        assert with_kernel[key] == with_torch[key], key
    a, b = ref.double().reshape(-1), value.double().reshape(-1)
    if case != "nan":  # the kernel's float64 sums are the float64 result; torch's float32 ones within 1e-4
        exact = {"rel_l2": ((a - b).norm() / a.norm()).item(), "max_abs": (a - b).abs().max().item(),
                 "cosine": min(1.0, (a @ b / (a.norm() * b.norm())).item())}
        for key, want in exact.items():
            assert with_kernel[key] == pytest.approx(want, rel=1e-9, abs=1e-15), key
            assert with_torch[key] == pytest.approx(want, rel=1e-4, abs=1e-12), key
        assert rel_kernel == pytest.approx(exact["rel_l2"], rel=1e-9, abs=1e-15)
        assert rel_torch == pytest.approx(exact["rel_l2"], rel=1e-4, abs=1e-12)
    else:
        for key in ("rel_l2", "max_abs", "cosine"):
            assert with_kernel[key] == pytest.approx(with_torch[key], rel=1e-12), key
    if case == "equal":
        assert (with_kernel["rel_l2"], with_kernel["max_abs"], with_kernel["cosine"]) == (0.0, 0.0, 1.0)
    if case == "nan":
        assert with_kernel["nan"] == 1 and with_kernel["mismatch"] == 1
    if case == "far":
        assert with_kernel["rel_l2"] == pytest.approx(math.sqrt(2), rel=0.01)
