"""Low-precision recipes as they train: torchao's float8 (and MX) targets replayed against an fp32 or bf16 reference.

The models of `model_files/float8_models.py` convert their own Linears with torchao (`--model-arg float8=...`, as
torchtitan's converter does) or are converted by oneiter (`record --float8`). A call that runs a recipe is judged
against the recipe's exact emulation on the reference's inputs (its noise: the accumulation's), and the format's own
cost is reported beside it, never as a fault. Faults live in the model file (faultkit's `instance:` wrapper around a
converted Linear) or in a stand-in plugin kernel (`model_files/scaled_mm_kernels.py`: torch's CPU `_scaled_mm` with
one scale 1 % off, registered with torch.library, knowing nothing of oneiter).
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import MODEL_FILES, record_small, replay, replay_with_fault, run_cli

import oneiter

pytest.importorskip("torchao")

MLP = str(MODEL_FILES / "float8_models.py:build_mlp")
LLAMA = str(MODEL_FILES / "float8_models.py:build_llama")
FIRST = "model.layers.0.self_attn.q_proj"  # the Llama's first converted Linear


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """References recorded once, by (model, dtype): float32 and bfloat16 runs of the unconverted models."""
    made = {}

    def get(model: str, dtype: str = "float32", batch_size: int = 2):
        key = (model, dtype, batch_size)
        if key not in made:
            made[key] = tmp_path_factory.mktemp("f8ref") / "ref.h5"
            record_small(made[key], model, dtype=dtype, batch_size=batch_size)
        return made[key]

    return get


@pytest.fixture(scope="module")
def targets(refs, tmp_path_factory):
    """Clean float8 replays of the fp32 references, recorded once, by (model, recipe)."""
    made = {}

    def get(model: str, recipe: str):
        if (model, recipe) not in made:
            made[(model, recipe)] = tmp_path_factory.mktemp("f8tgt") / "tgt.h5"
            replay(refs(model), made[(model, recipe)], model_args={"float8": recipe})
        return made[(model, recipe)]

    return get


@pytest.fixture
def stand_in():
    """The stand-in plugin's `_scaled_mm` kernel, importable as a plugin is; removed after the test."""
    sys.path.insert(0, str(MODEL_FILES))
    import scaled_mm_kernels

    yield scaled_mm_kernels
    scaled_mm_kernels.uninstall()
    sys.path.remove(str(MODEL_FILES))


def verdict(ref, tgt):
    return oneiter.compare(str(ref), str(tgt)).verdict_obj


def assert_clean(v, recipe: str, calls: int):
    """MATCH, every converted call judged against its recipe, the format's cost stated and within reason."""
    assert v.status == "match", v.headline
    (found,) = v.formats["recipes"]
    assert (found["recipe"], found["num_calls"], found["num_flagged"]) == (recipe, calls, 0)
    assert 1e-2 < v.formats["first"]["format_cost"] < 1e-1  # FP8's own rounding at a Linear's output: ~4e-2
    assert v.formats["worst"]["ratio"] <= 1.0  # a correct kernel stays inside its accumulation noise
    assert any(line.startswith("format: the target runs") and "follows the recipe" for line in v.details)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_clean_float8_mlp_replay_matches_its_fp32_reference(refs, targets, recipe):
    assert_clean(verdict(refs(MLP), targets(MLP, recipe)), f"torchao.float8 {recipe}", 3)


def test_each_recipe_row_holds_its_recipe_deviation_and_the_formats_cost(refs, targets, tmp_path):
    """The /local columns (`format/schema.py`), and a file written before them, which reads without them."""
    import shutil

    import h5py
    import numpy as np

    from oneiter.format.layout import IterationFile

    with IterationFile(targets(MLP, "tensorwise")) as f:
        rows = {(r.module, r.phase, r.tensor): r for r in f.local_rows()}
    out = rows[("0", "forward", "output")]
    assert (out.recipe, out.calibration) == ("torchao.float8 tensorwise", "recipe")
    assert out.rel_l2 == pytest.approx(out.format_cost, rel=1e-3) and out.recipe_rel_l2 < 4 * out.noise_target
    assert rows[("1", "forward", "output")].recipe == ""  # a ReLU runs no recipe
    old = tmp_path / "old.h5"
    shutil.copy(targets(MLP, "tensorwise"), old)
    with h5py.File(old, "r+") as f:
        table, attrs = f["local"][()], dict(f["local"].attrs)
        kept = [n for n in table.dtype.names if n not in ("recipe", "recipe_rel_l2", "format_cost")]
        del f["local"]
        f.create_dataset("local", data=np.array(table[kept].tolist(), dtype=[(n, table.dtype[n]) for n in kept]))
        f["local"].attrs.update(attrs)
    with IterationFile(old) as f:
        assert {r.recipe for r in f.local_rows()} == {""}


@pytest.mark.parametrize("recipe, dtype", [("tensorwise", "bfloat16"), ("rowwise", "float32")])
def test_a_clean_float8_mlp_replay_matches_its_bf16_reference(refs, tmp_path, recipe, dtype):
    """A bfloat16 reference, and an FP8 target in bfloat16 (rounding the recipe's output to its grid) or in float32."""
    ref = refs(MLP, "bfloat16")
    replay(ref, tmp_path / "t.h5", model_args={"float8": recipe}, dtype=dtype)
    assert_clean(verdict(ref, tmp_path / "t.h5"), f"torchao.float8 {recipe}", 3)


def test_a_clean_float8_llama_replay_matches_with_its_lm_head_in_high_precision(refs, targets):
    """Rowwise here; tensorwise is `record --float8 tensorwise` below."""
    v = verdict(refs(LLAMA), targets(LLAMA, "rowwise"))
    assert_clean(v, "torchao.float8 rowwise", 14)  # 2 layers x 7 Linears; lm_head left out
    assert v.formats["first"]["module"] == FIRST
    assert not any(c["module"] == "lm_head" for c in v.formats["calls"])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_clean_float8_llama_replay_matches_its_bf16_reference(refs, tmp_path, recipe):
    ref = refs(LLAMA, "bfloat16")
    replay(ref, tmp_path / "t.h5", model_args={"float8": recipe}, dtype="bfloat16")
    assert_clean(verdict(ref, tmp_path / "t.h5"), f"torchao.float8 {recipe}", 14)


@pytest.mark.parametrize("model, recipe, layer", [(MLP, "tensorwise", "2"),
                                                  (LLAMA, "rowwise", "model.layers.1.mlp.down_proj")],
                         ids=["mlp-tensorwise", "llama-rowwise"])
def test_a_1e_3_error_in_a_converted_linears_forward_is_named(refs, tmp_path, monkeypatch, model, recipe, layer):
    """The format costs ~4e-2 there; the error is 1e-3, and is named: the call's deviation from its recipe."""
    replay_with_fault(refs(model), tmp_path / "t.h5", f"instance:{layer}:1e-3", monkeypatch,
                      model_args={"float8": recipe})
    v = verdict(refs(model), tmp_path / "t.h5")
    c = v.culprit
    assert (v.status, c.module, c.phase, c.tensor, c.recipe) == ("diverged", layer, "forward", "output",
                                                                f"torchao.float8 {recipe}")
    assert c.local_rel_l2 == pytest.approx(1e-3, rel=0.05) and c.ratio > 100 and c.format_cost > 1e-2
    assert f"its deviation from its recipe (torchao.float8 {recipe})" in v.headline


def test_a_scaled_mm_kernel_one_scale_off_is_named_at_the_first_converted_linear_and_by_replay_ops(
        refs, tmp_path, stand_in):
    stand_in.install(0.01)
    replay(refs(LLAMA), tmp_path / "t.h5", model_args={"float8": "tensorwise"})
    v = verdict(refs(LLAMA), tmp_path / "t.h5")
    assert (v.culprit.module, v.culprit.call, v.culprit.phase) == (FIRST, 0, "forward")
    assert v.culprit.local_rel_l2 == pytest.approx(1e-2, rel=0.05)
    ops = tmp_path / "ops.json"
    res = run_cli("replay", refs(LLAMA), "-l", FIRST, "-m", LLAMA, "--float8", "tensorwise", "--ops", "--json", ops)
    first = next(r for r in json.loads(ops.read_text())["ops"] if r["flagged"])
    assert (res.exit_code, first["op"], first["phase"]) == (1, "aten::_scaled_mm", "forward"), res.output
    stand_in.uninstall()  # the same layer on torch's own kernel: no op flagged
    assert run_cli("replay", refs(LLAMA), "-l", FIRST, "-m", LLAMA, "--float8", "tensorwise", "--ops").exit_code == 0


def test_a_kernel_error_below_bf16s_resolution_is_named_in_a_bf16_target(refs, tmp_path, stand_in):
    """In bfloat16, 1e-3 is a quarter of a unit: the kernel's error moves results across rounding boundaries, which
    a correct kernel (within its accumulation of them) never does."""
    ref = refs(MLP, "bfloat16")
    stand_in.install(1e-3)
    replay(ref, tmp_path / "t.h5", model_args={"float8": "rowwise"}, dtype="bfloat16")
    c = verdict(ref, tmp_path / "t.h5").culprit
    assert (c.module, c.phase, c.recipe) == ("0", "forward", "torchao.float8 rowwise") and c.ratio > 100


def test_an_mx_target_matches_and_an_error_in_it_is_named(refs, tmp_path, monkeypatch):
    """torchao's MXFP8 (blocks of 32, e8m0 scales; its emulated kernels run on the CPU): batch 32 (its weight
    gradient's blocks run along the batch)."""
    ref = refs(MLP, batch_size=32)
    replay(ref, tmp_path / "t.h5", model_args={"float8": "mxfp8"})
    assert_clean(verdict(ref, tmp_path / "t.h5"), "torchao.mxfp8 rceil", 2)  # 32 -> 16 is no block of 32
    replay_with_fault(ref, tmp_path / "f.h5", "instance:2:1e-3", monkeypatch, model_args={"float8": "mxfp8"})
    c = verdict(ref, tmp_path / "f.h5").culprit
    assert (c.module, c.phase, c.recipe) == ("2", "forward", "torchao.mxfp8 rceil")


def test_record_float8_on_a_replay_prints_the_per_call_format_cost_table(refs, tmp_path):
    tgt = tmp_path / "fp8.h5"
    res = run_cli("record", "--replay", refs(LLAMA), "-m", LLAMA, "--float8", "tensorwise", "-o", tgt, "-q")
    assert res.exit_code == 0, res.output
    out = run_cli("compare", refs(LLAMA), tgt, "--html", tmp_path / "r.html", "--json", tmp_path / "r.json")
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert "float8 tensorwise" in text  # the target's line
    assert "formats: 14 calls run a low-precision recipe" in text
    assert "MATCH" in text and "format: the target runs torchao.float8 tensorwise (14 calls)" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("model.layers.")]
    assert len(rows) == 14 and rows[0][:3] == [f"{FIRST}@0", "torchao.float8", "tensorwise"]
    assert all(1e-2 < float(r[3]) < 1e-1 and r[-1].endswith("x") for r in rows)  # cost at each output; ratio
    calls = json.loads((tmp_path / "r.json").read_text())["verdict"]["formats"]["calls"]
    assert [c["module"] for c in calls] == [r[0].removesuffix("@0") for r in rows]
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Formats</h2><p>14 calls run a low-precision recipe" in page and f"<td>{FIRST}@0</td>" in page


def test_recorder_float8_converts_for_the_block_only(refs, tmp_path):
    """`Recorder(float8=...)`: the Linears are torchao's inside the block, the model's own after it."""
    from oneiter.runtime.modelspec import load_model
    from oneiter.runtime.training import build_optimizer

    bundle = load_model(MLP, 2, 0, {})
    opt = build_optimizer("sgd", bundle.model.parameters())  # the reference's optimizer
    seen = []
    with oneiter.Recorder(bundle.model, tmp_path / "t.h5", optimizer=opt, replay=refs(MLP), float8="rowwise") as rec:
        x = rec.inputs(*bundle.inputs)
        seen = [type(m).__name__ for m in bundle.model]
        bundle.loss_fn(bundle.model(x)).backward()
        opt.step()
    assert seen == ["Float8Linear", "ReLU", "Float8Linear", "ReLU", "Float8Linear"]
    assert [type(m).__name__ for m in bundle.model] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    v = verdict(refs(MLP), tmp_path / "t.h5")
    assert v.status == "match" and v.formats["recipes"][0]["recipe"] == "torchao.float8 rowwise", v.headline


def test_float8_options_are_checked_and_torchao_is_asked_for_by_name(monkeypatch, tmp_path):
    from oneiter.errors import OneIterError
    from oneiter.record.modes.float8 import convert

    with pytest.raises(OneIterError, match="float8 takes one of tensorwise, rowwise"):
        oneiter.Recorder(torch_linear(), tmp_path / "x.h5", float8="blockwise")
    with pytest.raises(OneIterError, match="drop amp"):
        oneiter.Recorder(torch_linear(), tmp_path / "x.h5", float8="tensorwise", amp="bf16")
    res = run_cli("record", "-m", MLP, "--float8", "rowwise", "--amp", "bf16", "-o", tmp_path / "y.h5")
    assert res.exit_code == 2 and "--float8" in res.stderr and "drop amp" in res.stderr
    model = torch_linear()
    undo = convert(model, "tensorwise")
    with pytest.raises(OneIterError, match="Float8Linear already"):
        convert(model, "rowwise")
    undo()
    assert type(model[0]).__name__ == "Linear"
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(OneIterError, match=r"pip install -c constraints.txt 'oneiter\[float8\]'"):
        convert(torch_linear(), "tensorwise")


def torch_linear():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 16))
