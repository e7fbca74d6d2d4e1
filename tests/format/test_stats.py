"""`record --level stats`: statistics and checksums per tensor, compare on them, and `compare --suggest`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import NEEDS_STATS_KERNEL, record_small, replay, run_cli

from oneiter.format import stats
from oneiter.format.layout import IterationFile
from oneiter.format.schema import decode, tensor_to_numpy
from oneiter.format.stats import array_stats, tensor_stats

_SEEDED = torch.manual_seed(0)  # the tensors below are built at collection: the same ones every run



@pytest.mark.parametrize("tensor", [
    torch.randn(1000), torch.randn(3, 5).to(torch.bfloat16), torch.randn(4, 6).to(torch.float16),
    torch.arange(10), torch.tensor([1.0, float("nan"), float("inf"), -2.0]), torch.randn(5, 5).t(),
    torch.tensor([True, False, True]), torch.tensor(3.5), torch.randn(2, 3, dtype=torch.float64), torch.zeros(0, 3),
    torch.tensor([float("nan")] * 3), torch.arange(3000, dtype=torch.int8), torch.randn(4, dtype=torch.cfloat).conj(),
])
@pytest.mark.parametrize("kernel", [True, False])  # the CPU's C kernel where it applies; torch's reductions
def test_statistics_on_the_device_equal_those_of_the_stored_array(tensor, kernel, monkeypatch):
    monkeypatch.setattr(stats, "SMALL", 0)  # torch's reductions, as on a device (numpy's: the test below)
    monkeypatch.setattr(stats.KERNEL, "use", kernel)
    mine = tensor_stats(tensor)
    raw, dtype = tensor_to_numpy(tensor.resolve_conj().contiguous())  # as the writer stores it
    theirs = array_stats(raw, decode(raw, dtype))
    assert mine.checksum == theirs.checksum and mine.kind == theirs.kind == "rowcol32"
    np.testing.assert_allclose(mine.values, theirs.values, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("small", [0, stats.SMALL])  # torch's reductions; numpy's for small CPU tensors
@pytest.mark.parametrize("chunk", [stats.CHUNK, 4 * stats.ROW])  # one chunk; many chunks, a partial last row
@pytest.mark.parametrize("tensor", [
    torch.randn(5000), torch.randn(3000).to(torch.bfloat16)[1:], torch.arange(7000),
    torch.tensor([2**62, -2**63, 2**63 - 1, 7] * 999), torch.rand(9001) > 0.5, torch.randn(2, 3000).to(torch.cfloat),
    torch.randn(70, 90, dtype=torch.float64).t(), torch.tensor([1.0, float("nan"), float("inf"), -2.0] * 3000),
])
def test_the_checksum_and_statistics_computed_in_chunks_equal_those_of_the_stored_bytes(tensor, chunk, small, kernel,
                                                                                       monkeypatch):
    """`rowcol32` is what a stats file holds on every device; a full file's bytes must give the same two numbers
    (int32 and int64 wrap-around included), chunk by chunk or at once, or a full file could never be proved bitwise
    equal to it. A bfloat16 view at an odd offset is not int32-aligned in memory: it is copied first."""
    monkeypatch.setattr(stats, "CHUNK", chunk)
    monkeypatch.setattr(stats, "SMALL", small)
    monkeypatch.setattr(stats.KERNEL, "use", kernel)
    mine = tensor_stats(tensor)
    raw, dtype = tensor_to_numpy(tensor.resolve_conj().contiguous())  # as the writer stores it
    theirs = array_stats(raw, decode(raw, dtype))
    assert mine.kind == theirs.kind == "rowcol32" and mine.checksum == theirs.checksum
    np.testing.assert_allclose(mine.values, theirs.values, rtol=1e-5, equal_nan=True)
    t = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    moved = t.flatten().roll(1).reshape(t.shape)
    assert tensor_stats(moved).checksum != mine.checksum or bool((moved == t).all())


@NEEDS_STATS_KERNEL
def test_the_c_kernel_is_built_and_takes_cpu_floats_in_one_pass(monkeypatch):
    """Where the install can build the kernel it has (a failed build fails here); it answers for float32,
    float64, bfloat16 and complex CPU tensors (whatever their size), and leaves every other dtype to torch/numpy."""
    assert stats.KERNEL.available
    calls = []
    kernel, _ = stats.KERNEL.load()
    monkeypatch.setattr(stats.KERNEL, "_loaded", (type("Spy", (), {"reduce": staticmethod(
        lambda *a: calls.append(a[2]) or kernel.reduce(*a))})(), stats.KERNEL.load()[1]))
    for t in (torch.randn(3), torch.randn(5000, dtype=torch.float64), torch.randn(70).to(torch.bfloat16),
              torch.randn(4, dtype=torch.cfloat), torch.arange(9), torch.randn(8).half()):
        tensor_stats(t)
    assert calls == [0, 1, 2, 0]
    big = torch.randn(3, 1000, 1001)  # rows of the checksum and lanes of the statistics both end mid-way
    big[1, 2, 3], big[2, 0, 0] = float("nan"), float("-inf")
    mine = tensor_stats(big)
    raw, dtype = tensor_to_numpy(big)
    theirs = array_stats(raw, decode(raw, dtype))
    assert mine.checksum == theirs.checksum and mine["nan"] == 1 and mine["inf"] == 1
    np.testing.assert_allclose(mine.values, theirs.values, rtol=1e-12)  # float64 lanes: as exact as numpy's


@NEEDS_STATS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_c_kernel_portable_path_equals_its_vectorized_one(dtype):
    """`reduce(..., vectorized=False)`: the scalar loops a CPU without AVX2 would run give the same checksum and
    statistics (to float64 summation order) as the AVX2 path, on rows that end mid-lane, an odd offset and NaN."""
    kernel, kinds = stats.KERNEL.load()
    base = torch.randn(5 * 1024 + 13, dtype=torch.float64).to(dtype)
    for t in (base, base[1:], torch.cat([base[:7], torch.tensor([float("nan")], dtype=dtype), base[7:]])):
        fast = kernel.reduce(t.data_ptr(), t.numel(), kinds[dtype])
        slow = kernel.reduce(t.data_ptr(), t.numel(), kinds[dtype], False)
        assert fast[5:] == slow[5:]  # counts and checksum, exactly
        np.testing.assert_allclose(fast[:5], slow[:5], rtol=1e-12)


def test_the_checksum_sees_one_changed_bit_and_two_swapped_words_anywhere(monkeypatch):
    """A flipped bit in any word and a swap of two different words change it, in the same row, the same column,
    or neither; the same tensor gives the same checksum with 1 or 2 threads (torch's reductions)."""
    monkeypatch.setattr(stats, "SMALL", 0)
    base = torch.randn(4 * stats.ROW + 5)
    same = tensor_stats(base).checksum
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert tensor_stats(base.clone()).checksum == same
    finally:
        torch.set_num_threads(threads)
    for i in (0, 17, stats.ROW, 4 * stats.ROW + 4):
        for bit in (0, 22, 31):
            flipped = base.clone()
            flipped.view(torch.int32)[i] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert tensor_stats(flipped).checksum != same, (i, bit)
    for i, j in ((0, 1), (3, stats.ROW + 3), (5, 2 * stats.ROW + 9), (0, 4 * stats.ROW + 4)):
        swapped = base.clone()
        swapped[[i, j]] = base[[j, i]]
        assert tensor_stats(swapped).checksum != same, (i, j)


def test_the_checksum_sees_a_moved_nan_and_a_flipped_infinity():
    a = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    moved, flipped = torch.tensor([float("nan"), 1.0, 2.0, float("inf")]), torch.tensor([1.0, float("nan"), 2.0,
                                                                                          float("-inf")])
    same = tensor_stats(a.clone())
    assert tensor_stats(a).checksum == same.checksum
    assert tensor_stats(moved).checksum != same.checksum and tensor_stats(flipped).checksum != same.checksum
    assert (tensor_stats(a)["nan"], tensor_stats(a)["inf"]) == (1, 1)


@pytest.fixture(scope="module")
def stats_ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "ref.h5"
    record_small(out, "resnet18", level="stats")
    return out


def test_a_stats_replay_on_the_same_device_is_bitwise_by_checksum_and_small(stats_ref, tmp_path):
    tgt = tmp_path / "tgt.h5"
    replay(stats_ref, tgt, level="stats")
    with IterationFile(tgt) as f:
        assert f.level == "stats" and f.local_kind() == ""
        assert f.is_stats("state_before/conv1.weight") and f.is_stats(f.batch_paths()[0])
    assert tgt.stat().st_size < 400_000  # resnet18 at 32x32, batch 2: statistics only
    with IterationFile(stats_ref) as f:  # the reference keeps what a replay needs in full
        assert not f.is_stats("state_before/conv1.weight") and not f.is_stats(f.batch_paths()[0])
    res = run_cli("compare", stats_ref, tgt, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["verdict"]["status"] == "match"
    assert all(row["max_abs"] == 0 for row in doc["rows"])  # equal checksums: bitwise equal, said as such


def test_a_fault_is_the_first_divergence_and_suggest_names_its_region(stats_ref, tmp_path):
    tgt = tmp_path / "bad.h5"
    replay(stats_ref, tgt, level="stats", faults=["layer3.1.conv2:forward=0.001"])
    res = run_cli("compare", stats_ref, tgt, "--suggest", "--json", tmp_path / "r.json")
    assert res.exit_code == 1
    verdict = json.loads((tmp_path / "r.json").read_text())["verdict"]
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == ("layer3.1.conv2", "forward", "output")
    assert "from statistics: the L2 norm or sum of |x| differs by" in verdict["reason"]
    assert "record 'layer3.1' and everything under it in full" in res.stdout
    assert "--include '^layer3\\.1(\\.|$)'" in res.stdout
    # the second step: that region in full on both sides names the culprit by local error
    ref_region, tgt_region = tmp_path / "ref.region.h5", tmp_path / "tgt.region.h5"
    record_small(ref_region, "resnet18", include=[r"^layer3\.1(\.|$)"])
    replay(ref_region, tgt_region, include=[r"^layer3\.1(\.|$)"], faults=["layer3.1.conv2:forward=0.001"])
    from oneiter.judge.iteration.engine import compare_files

    verdict = compare_files(ref_region, tgt_region).verdict()
    assert (verdict["basis"], verdict["module"], verdict["phase"]) == ("local_error", "layer3.1.conv2", "forward")


def test_a_full_target_compares_with_a_stats_reference(stats_ref, tmp_path):
    tgt = tmp_path / "full.h5"
    replay(stats_ref, tgt)  # full level: local blame is off (the reference has no data), said once
    with IterationFile(tgt) as f:
        assert f.level == "full" and f.local_kind() == ""
    res = run_cli("compare", stats_ref, tgt)
    assert res.exit_code == 0, res.output


def test_reading_data_a_stats_file_does_not_hold_is_one_line(stats_ref, tmp_path):
    res = run_cli("replay", stats_ref, "--layer", "layer1.0.conv1")
    assert res.exit_code == 2 and "holds only statistics" in res.stderr
    res = run_cli("inspect", stats_ref)
    assert res.exit_code == 0 and "layer1.0.conv1@0" in res.stdout
