"""What a recording's parts form, checked as structures (`format/consistency.py`), and values judged against what
they were computed from: each case of a second, independent fuzzing round is refused (exit 2, one line naming the
object) or judged (exit 1), never a MATCH, an internal error or a hang.

The recordings are the MLP set of `mutants.make_pair` (reference, replay target with local data, plain second
recording, statistics-level recording)."""

from __future__ import annotations

import shutil

import h5py
import mutants
import numpy as np
import pytest
from conftest import run_cli


@pytest.fixture(scope="session")
def pair(mlp_pair):
    return mlp_pair  # the MLP recordings, made once per session (conftest)


def mutate(pair, tmp_path, edit, base: str = "target"):
    path = tmp_path / "bad.h5"
    shutil.copy({"target": pair.target, "plain": pair.plain, "stats": pair.stats}[base], path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def refused(res) -> str:
    """Exit 2 with one line on stderr; returns it."""
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return lines[0]


def _unprobed(f, module: str, call: int) -> None:
    old = f["unprobed"][()]
    row = np.array([(module.encode(), call, b"forged")], dtype=old.dtype)
    del f["unprobed"]
    f.create_dataset("unprobed", data=np.concatenate([old, row]))


def _parent(child: str, parent: str, also: tuple[str, str] | None = None, unprobed: bool = True):
    def edit(f):
        f[f"calls/{child}"].attrs["parent"] = parent
        if also:
            f[f"calls/{also[0]}"].attrs["parent"] = also[1]
        if unprobed:
            _unprobed(f, *child.split("@")[:1], 0)
    return edit


def _row0(table_name: str, **columns):
    """Columns of row 0 of a table (`local`, `stats`) set."""
    def edit(f):
        table = f[table_name][()]
        for name, value in columns.items():
            table[name][0] = value
        f[table_name][...] = table
    return edit


def _local(**columns):
    return _row0("local", **columns)


def _stats(**columns):
    return _row0("stats", **columns)


def _times(path: str, k: float):
    def edit(f):
        f[path][...] = f[path][()] * np.float32(k)
    return edit


def _duplicate_call(pair):
    def edit(f):
        f["calls/0@0/forward/output"][...] = f["calls/0@0/forward/output"][()] * 100
        with h5py.File(pair.ref, "r") as ref:
            ref.copy("calls/0@0", f["calls"], name="copy@0")  # its module and call attributes say 0@0
    return edit


def _duplicate_stats(f):
    table = f["stats"][()]
    i = next(i for i, r in enumerate(table) if r["path"].decode() == "calls/0@0/forward/output")
    row = table[i].copy()
    for name in ("min", "max", "mean", "l2", "abs_sum"):
        row[name] *= 1000
    row["checksum0"] += 1
    del f["stats"]
    f.create_dataset("stats", data=np.concatenate([table[:i], [row], table[i:]]))


def _without_rows_of(call: str, k: float):
    def edit(f):
        module = call.split("@")[0]
        table = f["local"][()]
        keep = table[[r["module"].decode() != module for r in table]]
        del f["local"]
        f.create_dataset("local", data=keep)
        _times(f"calls/{call}/forward/output", k)(f)
    return edit


REFUSED = {  # case: (base, edit, the one line compare and inspect print, after the file name)
    "a call that is its own parent": ("target", _parent("2@0", "2@0"), "call group '2@0': its parents form a cycle "
                                                                        "(2@0 -> 2@0)"),
    "two calls each other's parent": ("target", _parent("1@0", "2@0", also=("2@0", "1@0")),
                                      "call group '1@0': its parents form a cycle (1@0 -> 2@0 -> 1@0)"),
    "a parent that is no call": ("plain", _parent("1@0", "9@0", unprobed=False),
                                 "call group '1@0' has parent '9@0', which is no call of the file"),
    "a second /stats row for an entry": ("stats", _duplicate_stats,
                                         "/stats row 1: a second row for 'calls/0@0/forward/output' (one row per "
                                         "entry)"),
    "a /stats value inf": ("stats", _stats(l2=np.inf), "/stats row 0 ('calls/0@0/forward/output'): l2 inf, expected "
                                                       ">= 0 (finite for float32)"),
    "a /stats numel inf": ("stats", _stats(numel=np.inf), "/stats row 0 ('calls/0@0/forward/output'): numel inf is "
                                                          "not a whole number >= 0"),
    "rel_l2 -1": ("target", _local(rel_l2=-1.0), "/local row 0 (0@0 forward output): rel_l2 -1.0, expected >= 0 "
                                                 "(or NaN)"),
    "rel_l2 -inf": ("target", _local(rel_l2=-np.inf), "/local row 0 (0@0 forward output): rel_l2 -inf, expected >= "
                                                      "0 (or NaN)"),
    "nan=100 with nan_ref=0, mismatch=0": ("target", _local(nan=100, nan_ref=0, mismatch=0),
                                           "/local row 0 (0@0 forward output): more NaN/Inf than its 24 elements"),
    "nan=10 with nan_ref=0, mismatch=0": ("target", _local(nan=10, nan_ref=0, mismatch=0),
                                          "/local row 0 (0@0 forward output): mismatch 0 with NaN 0|10 and Inf 0|0 "
                                          "(reference|target): expected from 10 to 10"),
    "inf=5 with mismatch=-5": ("target", _local(inf=5, mismatch=-5), "/local row 0 (0@0 forward output): mismatch "
                                                                     "-5, expected a whole number >= 0"),
    "noise_target=10 with rel_l2=1": ("target", _local(noise_target=10.0, rel_l2=1.0),
                                      "/local row 0 (0@0 forward output): rel_l2 1.0 with max_abs 0: no difference, "
                                      "yet an error"),
    "local rows deleted, output x1.5": ("target", _without_rows_of("2@0", 1.5),
                                        "call 2@0 holds local data for no tensor and is not listed in /unprobed: its "
                                        "rows are missing, so the file is damaged (record the target again)"),
    "local rows deleted, output x3": ("target", _without_rows_of("2@0", 3.0),
                                      "call 2@0 holds local data for no tensor and is not listed in /unprobed: its "
                                      "rows are missing, so the file is damaged (record the target again)"),
    "num_ops 2**62": ("plain", lambda f: f["random"].attrs.__setitem__("num_ops", 2**62),
                      "group '/random' says num_ops 4611686018427387904 but holds 1 random ops (first missing: 1); "
                      "the file is damaged"),
    "an op name that records another number of outputs": (
        "plain", lambda f: f["random/00000"].attrs.__setitem__("op", "aten.native_dropout.default"),
        "random op 0: aten.native_dropout.default records 2 output(s), the file holds 1 ([0])"),
    "batch_size 2**31": ("plain", lambda f: f.attrs.__setitem__("batch_size", 2**31),
                         "root attribute 'batch_size' is 2147483648, but the recorded batch holds 12 elements in all "
                         "(a builder makes at least one per sample)"),
    "a call of a microbatch the iteration did not run": (
        "plain", lambda f: f["calls/1@0"].attrs.__setitem__("microbatch", 1),
        "call group '1@0' has microbatch 1, expected an integer from 0 to 0 (the root attribute 'microbatches' is 1)"),
    "a batch tensor of microbatch -1": (
        "plain", lambda f: f["batch/input.0"].attrs.__setitem__("microbatch", -1),
        "batch tensor '/batch/input.0' has microbatch -1, expected an integer from 0 to 0 (the root attribute "
        "'microbatches' is 1)"),
    "two microbatches without their losses": (
        "plain", lambda f: f.attrs.__setitem__("microbatches", 2),
        "/microbatch_loss should hold the 2 microbatches' losses (shape [2]), got none"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_structure_no_recording_holds_is_refused_by_every_reader(pair, tmp_path, case):
    base, edit, message = REFUSED[case]
    path = mutate(pair, tmp_path, edit, base)
    line = f"error: '{path}': {message}"
    assert refused(run_cli("compare", pair.ref, path)) == line
    assert refused(run_cli("inspect", path)) == line


def test_a_second_group_for_one_call_is_refused(pair, tmp_path):
    path = mutate(pair, tmp_path, _duplicate_call(pair), "plain")
    changed_alone = mutate(pair, tmp_path / "..", _times("calls/0@0/forward/output", 100.0), "plain")
    assert run_cli("compare", pair.ref, changed_alone).exit_code == 1
    assert refused(run_cli("compare", pair.ref, path)) == (
        f"error: '{path}': call group 'copy@0' has module '0' and call 0, whose group is '0@0': one group per module "
        f"call")


def test_a_batch_size_no_batch_holds_is_refused_before_a_replay_builds_the_model(pair, tmp_path):
    path = mutate(pair, tmp_path, lambda f: f.attrs.__setitem__("batch_size", 2**31), "plain")
    spec = f"{mutants.__file__}:build"
    assert "'batch_size' is 2147483648" in refused(run_cli("replay", path, "--layer", "0", "--model", spec))
    out = tmp_path / "replayed.h5"
    assert "'batch_size' is 2147483648" in refused(run_cli("record", "--replay", path, "--model", spec, "-o", out))
    assert not out.exists()


JUDGED = {  # case: (edit of the replay target, the verdict's entry, what its reason says)
    "param_grads x1000 under clean local rows": (
        _times("param_grads/0.weight", 1000.0), "0@0 param_grad weight",
        "rel_l2 9.99e+02, although everything it was computed from is bitwise the reference's and its own code, "
        "rerun on those values, differs by only 0.00e+00: the value is not what its code computes"),
    "an output x1.5 under clean local rows": (
        _times("calls/1@0/forward/output", 1.5), "1@0 forward output",
        "rel_l2 5.00e-01, although everything it was computed from is bitwise the reference's"),
    "an updated weight x1.5 under clean local rows": (
        _times("state_after/0.weight", 1.5), "0@0 optimizer weight",
        "rel_l2 of its update"),
    "noise_target=10 with rel_l2=1 and max_abs=1": (
        _local(noise_target=10.0, rel_l2=1.0, max_abs=1.0), "0@0 forward output",
        "rel_l2 0.00e+00, from values all bitwise the reference's, yet its local row claims its own code differs by "
        "1.00e+00: the file contradicts itself"),
}


@pytest.mark.parametrize("case", list(JUDGED))
def test_a_value_its_sources_do_not_explain_is_never_drift(pair, tmp_path, case):
    """Everything each of these was computed from is bitwise the reference's, so its accumulated error is its own
    code's: it must agree with its local row, whichever side was forged."""
    edit, entry, why = JUDGED[case]
    path = mutate(pair, tmp_path, edit)
    res = run_cli("compare", pair.ref, path)
    assert res.exit_code == 1, res.output
    headline = res.stdout.splitlines()[0]
    assert headline.startswith(f"DIVERGED (unattributed) at {entry}: no call's own code is to blame, but this "
                               f"entry's ") and why in headline, headline


def _rank_run(pair, tmp_path):
    ref_dir, tgt_dir = mutants.rank_dirs(pair, tmp_path)
    return ref_dir, tgt_dir


def test_a_clean_rank_file_beside_a_diverged_one_is_no_match(pair, tmp_path):
    ref_dir, tgt_dir = _rank_run(pair, tmp_path)
    shutil.copy(tgt_dir / "tgt.rank0.h5", tgt_dir / "tgt.rank00.h5")
    with h5py.File(tgt_dir / "tgt.rank0.h5", "r+") as f:
        f["calls/0@0/forward/output"][...] = f["calls/0@0/forward/output"][()] * 100
    assert refused(run_cli("compare", ref_dir, tgt_dir)) == (
        f"error: '{tgt_dir / 'tgt.rank00.h5'}' looks like a rank file but is not named <name>.rank<R>.h5 with R as "
        f"torchrun numbers ranks (0, 1, ... without leading zeros): rename or remove it")


@pytest.mark.parametrize("change, message", [
    (("attr", "world_size", 2**40), "the rank files disagree on the world size: rank 0 says 2, rank 1 says "
                                    "1099511627776"),
    (("attr", "rank", 0), "is named rank 1 but records rank 0"),
    (("rename", "tgt.rank99999999999999999999.h5", 1), "looks like a rank file but is not named"),
    (("rename", "tgt.rank2.h5", 2), "is rank 2, but its run has world_size 2: ranks are 0 to 1"),
    (("rename", "tgt.rank2.h5", 1), "is named rank 2 but records rank 1"),
])
def test_rank_files_agree_on_their_names_ranks_and_world_size(pair, tmp_path, change, message):
    ref_dir, tgt_dir = _rank_run(pair, tmp_path)
    one = tgt_dir / "tgt.rank1.h5"
    if change[0] == "attr":
        with h5py.File(one, "r+") as f:
            f.attrs[change[1]] = change[2]
    else:
        with h5py.File(one, "r+") as f:
            f.attrs["rank"] = change[2]
        one.rename(tgt_dir / change[1])
    assert message in refused(run_cli("compare", ref_dir, tgt_dir))


def test_a_world_size_of_2_to_the_40_is_refused_without_allocating(pair, tmp_path):
    ref_dir, tgt_dir = _rank_run(pair, tmp_path)
    for rank in (0, 1):
        with h5py.File(tgt_dir / f"tgt.rank{rank}.h5", "r+") as f:
            f.attrs["world_size"] = 2**40
    assert "rank 2 of 1099511627776 is missing (found ranks 0, 1)" in refused(run_cli("compare", ref_dir, tgt_dir))


def test_a_call_with_nothing_of_its_own_needs_no_rows_and_one_with_something_does(tmp_path):
    """An nn.Identity hands its input back: its output is stored as its input, so it has no local row and is no
    unprobed call, and the file is whole; the same call with an output of its own and no row is damage."""
    import torch
    from torch import nn

    import oneiter
    from oneiter.format.layout import IterationFile

    def run(out, replay=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Identity(), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with oneiter.Recorder(model, out, optimizer=opt, replay=replay, name="identity") as rec:
            model(rec.inputs(torch.randn(3, 4))).square().mean().backward()
            opt.step()

    run(tmp_path / "ref.h5")
    run(tmp_path / "tgt.h5", replay=tmp_path / "ref.h5")
    with IterationFile(tmp_path / "tgt.h5") as f:
        assert f.pass_through_calls() == {("1", 0)} and f.unprobed() == []
        assert ("1", 0) not in {(r.module, r.call) for r in f.local_rows()}
    assert run_cli("compare", tmp_path / "ref.h5", tmp_path / "tgt.h5").exit_code == 0

    def own_output(f):  # the output stored on its own, x1.5: no longer the input handed back
        value = f["calls/1@0/forward/output"][()] * np.float32(1.5)
        del f["calls/1@0/forward/output"]
        f.create_dataset("calls/1@0/forward/output", data=value).attrs["dtype"] = "float32"

    path = tmp_path / "forged.h5"
    shutil.copy(tmp_path / "tgt.h5", path)
    with h5py.File(path, "r+") as f:
        own_output(f)
    assert refused(run_cli("compare", tmp_path / "ref.h5", path)) == (
        f"error: '{path}': call 1@0 holds local data for no tensor and is not listed in /unprobed: its rows are "
        f"missing, so the file is damaged (record the target again)")


@pytest.mark.parametrize("attrs, message", [
    ({"placements": "Shard(dim=0)", "global_shape": [4]}, "attribute 'global_shape': expected 1 integers, each at "
                                                          "least the shard's [8]"),
    ({"placements": "Shard(dim=0)", "global_shape": [16], "global_offset": [12]},
     "attribute 'global_offset': expected one integer per dimension placing the shard inside [16]"),
    ({"global_shape": [16]}, "attribute 'placements': expected a string (the shard's placements)"),
])
def test_a_shards_placement_that_does_not_hold_it_is_refused(pair, tmp_path, attrs, message):
    """FSDP2 rank files say where each shard sits in the full tensor: it must fit."""
    def edit(f):
        f["state_before/0.bias"].attrs.update(attrs)
    path = mutate(pair, tmp_path, edit, "plain")
    line = refused(run_cli("inspect", path))
    assert line.startswith(f"error: '{path}': dataset '/state_before/0.bias' {message}"), line
