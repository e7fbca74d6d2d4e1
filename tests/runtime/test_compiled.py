"""Compiled models (torch.compile): recorded as they run, replayed against an eager reference, blamed per block.

A model arrives compiled in every way training code compiles it (`torch.compile(model)`, `model.compile()`,
`model.forward = torch.compile(...)`, compiled submodules), or oneiter compiles it (`record --compile`, one block
per module `--compile-modules` matches). The faults are not oneiter's: a model file's own (`faultkit`), active
inside the compiled code, and `wrong_backend.py`'s torch.compile backends, whose compiler pass perturbs one op's
result (they do not import oneiter). The cheap `aot_eager` backend checks the plumbing; inductor, the default
backend, runs in the slow tests (tiny shapes, its cache in a temporary folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import pytest
from conftest import MODEL_FILES, compare_verdict, record_small, replay, replay_with_fault, run_cli

from oneiter.runtime.compiled import eager_name

COMPILED = str(MODEL_FILES / "compiled.py:build")
LLAMA = str(MODEL_FILES / "hf_llama.py:build")


@pytest.fixture(autouse=True)
def _inductor_cache(tmp_path_factory, monkeypatch):
    """Inductor's cache in a temporary folder (shared by this module's tests), its compiles in this process."""
    folder = tmp_path_factory.getbasetemp() / "inductor_cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="module")
def cnn_ref(tmp_path_factory):
    """An eager reference of the functional CNN, through the model file that compiles it on the target side."""
    out = tmp_path_factory.mktemp("compiled") / "ref.h5"
    record_small(out, COMPILED, model_args={"how": "eager"})
    return out


def _attrs(path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["compiled"]) if "compiled" in f.attrs else {}


def _calls(path) -> list[str]:
    with h5py.File(path, "r") as f:
        return sorted(str(g.attrs["module"]) for g in f["calls"].values())


def test_orig_mod_is_dropped_from_names():
    assert eager_name("_orig_mod.0.weight") == "0.weight"
    assert eager_name("layers.1._orig_mod.mlp.down_proj.weight") == "layers.1.mlp.down_proj.weight"
    assert eager_name("_orig_mod") == ""
    assert eager_name("orig_mod.x") == "orig_mod.x"


@pytest.mark.parametrize("how", ["wrapper", "in_place", "forward", "blocks"])
def test_compiled_model_replays_its_eager_reference_bitwise(how, cnn_ref, tmp_path):
    """Every way a model arrives compiled records (no hook traced into a graph: the internal error this replaced),
    with the eager model's names, the blocks' calls only, and replays the eager reference: aot_eager computes what
    eager computes, bit for bit, so every entry matches and the verdict is a MATCH."""
    out = tmp_path / f"{how}.h5"
    args = {"how": how, "backend": "aot_eager", **({"blocks": "shared|head"} if how == "blocks" else {})}
    summary = replay(cnn_ref, out, model=COMPILED, model_args=args)
    info = _attrs(out)
    blocks = ["shared", "head"] if how == "blocks" else [""]
    assert sorted(info["blocks"]) == sorted(blocks)
    assert {b["backend"] for b in info["blocks"].values()} == {"aot_eager"}
    assert {b["eager"] for b in info["blocks"].values()} == {""}
    assert info["graph_breaks"] == []  # (graphs compiled by an earlier test of this process are reused: not counted)
    assert summary.compile_seconds == pytest.approx(info["compile_seconds"] + info["rerun_compile_seconds"], abs=2e-3)
    assert not any("_orig_mod" in m for m in _calls(out))
    with h5py.File(out, "r") as f:
        names = [str(n) for n in f["state_before"].attrs["order"]]
    assert "stem.weight" in names and not any("_orig_mod" in n for n in names)
    if how == "blocks":  # the eager root and block calls; the modules inside the blocks are not calls
        assert _calls(out) == ["", "block", "block.bn", "block.conv", "bn", "head", "shared", "shared", "stem"]
    else:
        assert _calls(out) == [""]
    code, verdict = compare_verdict(cnn_ref, out, tmp_path)
    assert (code, verdict["status"]) == (0, "match"), verdict["headline"]
    assert verdict["num_diverged"] == 0 and verdict["num_drift"] == 0
    hidden = verdict["compiled"]["hidden"]
    assert hidden and all(h["side"] == "target" for h in hidden)
    assert any(line.startswith("compiled: ") and "are not compared" in line for line in verdict["details"])
    ran = next(line for line in verdict["details"] if line.startswith("compiled: the target ran"))
    rerun = f" (+{info['rerun_compile_seconds']:.1f} s for its reruns)" if info["rerun_compile_seconds"] else ""
    assert f"{info['compile_seconds']:.1f} s compiling{rerun}, not in its record time" in ran, ran


def test_wrong_backend_names_the_block_holding_the_op(cnn_ref, tmp_path):
    """`record --compile wrong_gelu --compile-modules ...`: the backend's pass perturbs gelu's result by 1e-3; the
    block whose graph holds gelu (`shared`, called twice) is the culprit, its first call, forward."""
    out = tmp_path / "wrong.h5"
    res = run_cli("record", "--replay", cnn_ref, "-m", COMPILED, "--compile", "wrong_gelu", "--compile-modules",
                  "^(block|shared|head)$", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    assert "compiling" in res.stderr
    assert sorted(_attrs(out)["blocks"]) == ["block", "head", "shared"]
    code, verdict = compare_verdict(cnn_ref, out, tmp_path)
    assert code == 1
    culprit = verdict["culprit"]
    assert (culprit["module"], culprit["call"], culprit["phase"], culprit["tensor"]) == ("shared", 0, "forward",
                                                                                     "output")


def test_drill_traces_the_compiled_culprit_with_its_backend(cnn_ref, tmp_path):
    """`compare --drill` of a compiled target: the culprit block is traced compiled with the target's backend, and
    the printed command says `--compile wrong_gelu`."""
    out = tmp_path / "wrong.h5"
    replay(cnn_ref, out, model=COMPILED, compile="wrong_gelu", compile_modules=["^(shared|head)$"])
    res = run_cli("compare", cnn_ref, out, "--drill", "-m", COMPILED, "--json", tmp_path / "report.json")
    assert res.exit_code == 1, res.output
    drill = json.loads((tmp_path / "report.json").read_text())["drill"]
    assert "--compile wrong_gelu" in drill["command"]
    assert drill["ops"]["culprit"]["op"] == "fx::gelu"


def test_replay_ops_names_the_op_a_wrong_backend_pass_changed(cnn_ref, tmp_path):
    """`replay --layer shared --ops --compile wrong_gelu`: the compiled graph's nodes, each judged on its own
    inputs; the gelu node is flagged, at the model file's line; with the right backend no node is."""
    wrong = run_cli("replay", cnn_ref, "--layer", "shared", "--ops", "-m", COMPILED, "--compile", "wrong_gelu",
                    "--json", tmp_path / "wrong.json")
    assert wrong.exit_code == 1, wrong.output
    doc = json.loads((tmp_path / "wrong.json").read_text())
    assert doc["culprit"]["op"] == "fx::gelu"
    assert "functional_cnn.py" in doc["culprit"]["line"]
    assert [op["op"] for op in doc["ops"]] == ["fx::conv2d", "fx::gelu"]
    right = run_cli("replay", cnn_ref, "--layer", "shared", "--ops", "-m", COMPILED, "--compile", "aot_eager")
    assert right.exit_code == 0, right.output


def test_replay_ops_of_a_block_the_model_file_compiles(tmp_path):
    """A recording whose model file compiles `shared` itself with `wrong_gelu`: `replay --layer shared --ops`
    (no --compile) runs the block with the backend the rebuilt model compiles it with, and names the gelu node."""
    rec = tmp_path / "self_compiled.h5"
    record_small(rec, COMPILED, model_args={"how": "blocks", "blocks": "shared", "backend": "wrong_gelu"})
    res = run_cli("replay", rec, "--layer", "shared", "--ops", "-m", COMPILED, "--json", tmp_path / "ops.json")
    assert res.exit_code == 1, res.output
    doc = json.loads((tmp_path / "ops.json").read_text())
    assert doc["culprit"]["op"] == "fx::gelu"
    assert any("compiled with wrong_gelu" in note for note in doc["notes"]), doc["notes"]


def test_graph_breaks_are_reported_with_block_line_and_reason(tmp_path):
    """A data-dependent branch (`.item()`) breaks the compiled block's graph: the file lists the break with its
    block, the model's line and Dynamo's reason, and the record's note says so."""
    import torch

    import oneiter

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            if h.sum().item() > -1e9:  # a Python branch on a value: Dynamo breaks the graph here
                h = torch.relu(h)
            return self.b(h)

    model, notes = Branchy(), []
    with oneiter.Recorder(model, tmp_path / "r.h5", compile="aot_eager", notify=notes.append) as rec:
        model(rec.inputs(torch.randn(3, 4))).sum().backward()
    info = _attrs(tmp_path / "r.h5")
    assert len(info["graph_breaks"]) == 1, info
    (gb,) = info["graph_breaks"]
    assert gb["block"] == "" and gb["where"].endswith(f"test_compiled.py:{_line_of('if h.sum().item()')}")
    assert "item" in gb["reason"]
    assert info["blocks"][""]["graphs"] >= 1
    assert any("1 graph break(s) (first at " in n for n in notes), notes


def test_a_block_dynamo_gave_up_on_is_said_to_run_eagerly(tmp_path):
    """Past its recompile limit Dynamo runs a frame eagerly, with one warning: a recording whose block hit it says
    the block ran eagerly, never passes it off as compiled (the limit lowered to 2 for the test)."""
    import torch

    import oneiter

    class Widths(torch.nn.Module):  # a class of its own: no other test's compiled graphs on its code
        def __init__(self, width):
            super().__init__()
            self.fc = torch.nn.Linear(4, width)

        def forward(self, x):
            return torch.relu(self.fc(x))

    said = []
    with torch._dynamo.config.patch(recompile_limit=2):
        for k, width in enumerate((3, 5, 7)):  # other shapes: each a recompilation of Widths.forward
            model = torch.compile(Widths(width), backend="aot_eager")
            with oneiter.Recorder(model, tmp_path / f"r{k}.h5") as rec:
                model(rec.inputs(torch.randn(2, 4))).sum().backward()
            said.append(_attrs(tmp_path / f"r{k}.h5")["blocks"][""]["eager"])
    assert said[:2] == ["", ""]
    assert "recompile_limit (2)" in said[2] and "ran eagerly" in said[2], said


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)


def test_unknown_backend_is_one_line_exit_2(cnn_ref, tmp_path):
    res = run_cli("record", "--replay", cnn_ref, "-m", COMPILED, "--compile", "no_such_backend", "-o",
                  tmp_path / "x.h5")
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no backend 'no_such_backend'" in lines[0], res.stderr
    assert not (tmp_path / "x.h5").exists()


def test_compile_options_are_checked(tmp_path):
    from oneiter.errors import OneIterError
    from oneiter.record.options import RecordOptions

    assert RecordOptions(out=tmp_path / "a.h5", compile=True).compile == "inductor"
    with pytest.raises(OneIterError, match="compile_modules chooses"):
        RecordOptions(out=tmp_path / "a.h5", compile_modules=["x"])
    with pytest.raises(OneIterError, match="bad regular expression"):
        RecordOptions(out=tmp_path / "a.h5", compile="inductor", compile_modules=["("])
    with pytest.raises(OneIterError, match="fallback"):
        RecordOptions(out=tmp_path / "a.h5", compile="inductor", fallback=["convolution"])


RUNS: list[str] = []  # each run of a graph compiled by the `oneiter_test_counting` backend


def _counting_backend() -> str:
    """A registered torch.compile backend that counts the runs of the graphs it compiles (`RUNS`)."""
    import torch

    name = "oneiter_test_counting"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        def counting(gm, _example_inputs):
            def run(*args):
                RUNS.append(name)
                return gm.forward(*args)

            return run

        torch._dynamo.register_backend(name=name, compiler_fn=counting)
    return name


def test_recorder_compiles_for_the_block_and_undoes_it(tmp_path):
    """`Recorder(compile=...)`: inside the block, with oneiter's random-op mode active (torch.compile runs a model
    eagerly while a mode that does not ignore compiled code is on), the model runs its compiled graph once; after
    the block it is as it was."""
    import torch

    import oneiter

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = _counting_backend()
    RUNS.clear()
    with oneiter.Recorder(model, tmp_path / "r.h5", optimizer=opt, compile=backend) as rec:
        model(rec.inputs(torch.randn(3, 4))).sum().backward()
        opt.step()
    assert RUNS == [backend]
    assert "_compiled_call_impl" not in model.__dict__
    model(torch.randn(3, 4))
    assert RUNS == [backend]  # eager again
    info = _attrs(tmp_path / "r.h5")
    assert (info["blocks"][""]["backend"], info["blocks"][""]["eager"]) == (backend, "")
    assert _calls(tmp_path / "r.h5") == [""]


def test_a_block_torch_compile_leaves_eager_is_said(tmp_path):
    """`nn.Sequential.compile()` compiles nothing (Dynamo skips torch.nn's own frames): the file says it ran
    eagerly, with the reason, instead of passing it off as compiled."""
    import torch

    import oneiter

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.compile(backend="aot_eager")
    with oneiter.Recorder(model, tmp_path / "r.h5") as rec:
        model(rec.inputs(torch.randn(3, 4))).sum().backward()
    block = _attrs(tmp_path / "r.h5")["blocks"][""]
    assert (block["kind"], block["graphs"]) == ("in_place", 0)
    assert "ran eagerly" in block["eager"] and "Sequential" in block["eager"]


# -- inductor --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_model_file_returning_torch_compile_matches_its_eager_reference(cnn_ref, tmp_path):
    """The model file returns `torch.compile(model)` (inductor): `oneiter record` exits 0, a replay of the eager
    reference is a MATCH: every tensor judged within the noise of float32 (the block rerun through the compiled
    code against the same block run eagerly in float32 and in float64)."""
    alone = run_cli("record", "-m", COMPILED, "-b", "2", "-o", tmp_path / "alone.h5", "-q")
    assert alone.exit_code == 0, alone.output
    out = tmp_path / "inductor.h5"
    res = run_cli("record", "--replay", cnn_ref, "-m", COMPILED, "--model-arg", "how=wrapper", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    info = _attrs(out)
    assert info["blocks"][""]["backend"] == "inductor"
    assert info["cache_dir"] == os.environ["TORCHINDUCTOR_CACHE_DIR"]  # the user's cache folder, used and said
    assert any(Path(info["cache_dir"]).iterdir())
    code, verdict = compare_verdict(cnn_ref, out, tmp_path)
    assert (code, verdict["status"]) == (0, "match"), verdict["headline"]
    assert verdict["num_local"] >= 30 and verdict["num_flagged"] == 0
    assert verdict["unprobed"] == []  # the compiled rerun reproduced the live call (fidelity), so it was judged


@pytest.mark.slow
def test_fault_in_the_model_file_names_its_compiled_block(cnn_ref, tmp_path, monkeypatch):
    """A fault of the model's own code inside a compiled block (`shared.conv`'s forward, 1e-3), each block compiled
    by inductor on its own: the block holding it is named, not the root, not a clean block."""
    out = tmp_path / "fault.h5"
    replay_with_fault(cnn_ref, out, "instance:shared.conv", monkeypatch, model=COMPILED, compile="inductor",
                      compile_modules=["^(block|shared|head)$"])
    code, verdict = compare_verdict(cnn_ref, out, tmp_path)
    assert code == 1
    culprit = verdict["culprit"]
    assert (culprit["module"], culprit["call"], culprit["phase"]) == ("shared", 0, "forward")


@pytest.mark.slow
def test_llama_eager_reference_matches_inductor(tmp_path):
    """A tiny Hugging Face Llama compiled whole by inductor (`compile=`) against its eager reference: MATCH."""
    ref = tmp_path / "ref.h5"
    record_small(ref, LLAMA)
    out = tmp_path / "inductor.h5"
    summary = replay(ref, out, compile="inductor")
    assert summary.compile_seconds > 0
    info = _attrs(out)
    assert info["blocks"][""]["backend"] == "inductor" and info["graph_breaks"] == []
    code, verdict = compare_verdict(ref, out, tmp_path)
    assert (code, verdict["status"]) == (0, "match"), verdict["headline"]
    assert verdict["num_flagged"] == 0 and verdict["unprobed"] == []


@pytest.mark.slow
def test_wrong_backend_names_the_llama_decoder_layer_holding_silu(tmp_path):
    """A tiny Hugging Face Llama, each decoder layer compiled on its own by `wrong_silu` (its pass scales the result
    of every silu, the MLP's activation, by 1 + 1e-3): the first decoder layer is the culprit, in its forward."""
    ref = tmp_path / "ref.h5"
    record_small(ref, COMPILED, model_args={"model": "hf_llama", "how": "eager"})
    out = tmp_path / "wrong.h5"
    replay(ref, out, model=COMPILED, compile="wrong_silu", compile_modules=[r"^model\.layers\.\d+$"])
    info = _attrs(out)
    assert sorted(info["blocks"]) == ["model.layers.0", "model.layers.1"]
    assert {b["eager"] for b in info["blocks"].values()} == {""}
    code, verdict = compare_verdict(ref, out, tmp_path)
    assert code == 1, verdict["headline"]
    culprit = verdict["culprit"]
    assert (culprit["module"], culprit["call"], culprit["phase"]) == ("model.layers.0", 0, "forward")


# -- random numbers and activation checkpointing inside compiled code ----------------------------------------------
DROPOUT_LLAMA = {"checkpointing": "non_reentrant", "dropout": 0.1, "attn": "eager"}


@pytest.mark.slow
def test_compiled_blocks_that_checkpoint_and_drop_out_replay_an_eager_reference(tmp_path, monkeypatch):
    """`record --compile --compile-modules` of a Hugging Face Llama that checkpoints every decoder layer and drops
    out attention weights: each compiled layer runs its dropout inside `run_and_save_rng_state` and draws it again
    in backward (`run_with_rng_state`), which oneiter's random modes run with themselves inside; inductor draws the
    masks through aten ops (`fallback_random`), each replayed from the eager reference. A clean replay matches; a
    fault of the model's own code inside a compiled layer names that layer."""
    ref = tmp_path / "ref.h5"
    record_small(ref, LLAMA, model_args=dict(DROPOUT_LLAMA))
    clean = tmp_path / "clean.h5"
    res = run_cli("record", "--replay", ref, "-m", LLAMA, "--compile", "--compile-modules", r"model\.layers\.\d+",
                  "--seed", "3", "-o", clean)
    assert res.exit_code == 0, res.output
    assert ("compiled: 2 random op(s) in the compiled code (dropout) drawn through aten ops (inductor's "
            "fallback_random)") in res.stderr
    info = _attrs(clean)
    assert sorted(info["blocks"]) == ["model.layers.0", "model.layers.1"] and info["random_ops"] == 2
    code, verdict = compare_verdict(ref, clean, tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]
    fault = tmp_path / "fault.h5"
    replay_with_fault(ref, fault, "instance:model.layers.1.mlp.down_proj", monkeypatch, compile="inductor",
                      compile_modules=[r"model\.layers\.\d+"])
    code, verdict = compare_verdict(ref, fault, tmp_path)
    assert (code, verdict["basis"], verdict["module"], verdict["phase"]) == (1, "local_error", "model.layers.1",
                                                                             "forward"), verdict["headline"]


@pytest.mark.slow
def test_a_model_file_returning_torch_compile_with_dropout_takes_the_references_masks(tmp_path):
    """A model file returns `torch.compile(model)` of a network with two dropouts: compiled when it first runs, inside
    the recording, its masks are drawn through aten ops and replayed from the eager reference's, a match."""
    ref = tmp_path / "ref.h5"
    record_small(ref, COMPILED, model_args={"model": "dropout", "how": "eager"})
    out = tmp_path / "wrapper.h5"
    replay(ref, out, model=COMPILED, model_args={"how": "wrapper"}, seed=3)
    assert _attrs(out)["random_ops"] == 2
    code, verdict = compare_verdict(ref, out, tmp_path)
    assert (code, verdict["status"], verdict["basis"]) == (0, "match", "local_error"), verdict["headline"]


@pytest.mark.slow
def test_a_backend_that_draws_its_own_random_numbers_is_said_in_one_line(tmp_path):
    """A block compiled before oneiter records (here: with inductor's own generator, `fallback_random` off) draws
    inductor's seeds (`aten.randint`), not the reference's dropout: one line names the block, its backend and the
    fix, exit 2 — not a mismatch of random op numbers."""
    import torch

    from oneiter.errors import OneIterError
    from oneiter.record.recorder import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with Recorder(model, tmp_path / "ref.h5", optimizer=opt) as rec:
        model(rec.inputs(x)).sum().backward()
        opt.step()
    compiled = torch.compile(model)
    compiled(x).sum().backward()  # compiled before any recording: inductor's own random numbers
    opt.zero_grad()
    with pytest.raises(OneIterError, match=r"random op #0 ran in the compiled block \(root\) \(inductor\), whose "
                                           r"compiled code drew aten\.randint\.low_out .* where the reference drew "
                                           r"aten\.bernoulli_\.float shape \[4, 8\]"):
        with Recorder(compiled, tmp_path / "tgt.h5", optimizer=opt, replay=tmp_path / "ref.h5") as rec:
            compiled(rec.inputs(x)).sum().backward()
            opt.step()
