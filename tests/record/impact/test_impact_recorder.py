"""`Recorder(impact=True)` in a user's own loop: the iteration given as a function runs again from its start, the
recorded iteration is untouched by it, and what the API and the CLI refuse."""

from __future__ import annotations

import h5py
import pytest
import torch
from conftest import FAULT_ENV, MODEL_FILES, run_cli

import oneiter
from oneiter.errors import OneIterError
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.training import build_optimizer

PLANTED = str(MODEL_FILES / "planted.py:build")
FAULT = "instance_below64:layers.4:0.01"


@pytest.fixture(scope="module")
def reference(references):
    return references(PLANTED, batch_size=8)  # the one tests/judge/iteration/test_impact.py reads


def _planted(monkeypatch, fault: str = FAULT):
    monkeypatch.setenv(FAULT_ENV, fault)
    bundle = load_model(PLANTED, 8, 0)
    monkeypatch.delenv(FAULT_ENV)
    return bundle


def test_a_loop_gives_its_iteration_as_a_function_and_keeps_what_it_recorded(reference, tmp_path, monkeypatch):
    bundle = _planted(monkeypatch)
    model, opt = bundle.model, build_optimizer("sgd", bundle.model.parameters())
    out = tmp_path / "npu.h5"

    def iteration():
        opt.zero_grad(set_to_none=True)
        bundle.loss_fn(model(rec.inputs(*bundle.inputs))).backward()
        opt.step()

    with oneiter.Recorder(model, out, optimizer=opt, replay=reference, impact=True) as rec:
        rec.run(iteration)
    # nothing fixed, nothing fixed with the weights one rounding off, then layers.4 fixed (the only one: all fixed)
    assert rec.summary.impact_runs == 3
    # the runs left the model as the recorded iteration did: its updated weights and gradients, bit for bit
    with h5py.File(out) as f:
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), torch.from_numpy(f[f"state_after/{name}"][()])), name
            assert torch.equal(p.grad, torch.from_numpy(f[f"param_grads/{name}"][()])), name
        table = f["impact"][()]
        assert [r["kind"].decode() for r in table] == ["plain", "perturbed", "call"]
        assert f["impact"].attrs["check"] == 0.0
    fix = oneiter.compare(reference, out).verdict_obj.impact.fixes[0]
    assert (fix.module, fix.call, fix.phase, fix.tensor) == ("layers.4", 0, "forward", "output")
    assert fix.share > 0.9


def test_impact_without_the_iteration_as_a_function_is_refused(reference, tmp_path, monkeypatch):
    bundle = _planted(monkeypatch)
    opt = build_optimizer("sgd", bundle.model.parameters())
    with pytest.raises(OneIterError, match=r"rec\.run\(fn\)") as err:
        with oneiter.Recorder(bundle.model, tmp_path / "x.h5", optimizer=opt, replay=reference, impact=True) as rec:
            bundle.loss_fn(bundle.model(rec.inputs(*bundle.inputs))).backward()
            opt.step()
    assert err.value.param == "impact" and not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("options, message", [
    ({"impact": True}, "impact ranks the calls a replay flags: give replay too"),
    ({"impact_top": 2}, "impact_top bounds how many calls impact fixes: give impact too"),
    ({"impact": True, "impact_top": 0, "replay": "ref.h5"}, "impact_top must be an integer >= 1"),
    ({"impact": True, "replay": "ref.h5", "isolate": False}, "which isolate off turns off"),
    ({"impact": True, "replay": "ref.h5", "level": "stats"}, "which level stats does not measure"),
])
def test_impact_options_are_checked_when_built(options, message, tmp_path):
    with pytest.raises(OneIterError, match=message):
        oneiter.Recorder(torch.nn.Linear(2, 2), tmp_path / "x.h5", **options)


def test_the_cli_bounds_the_calls_it_fixes_and_compare_says_so(reference, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "instance_below64:first:0.02;instance_below64:layers.4:0.01")
    res = run_cli("record", "--replay", reference, "--model", PLANTED, "--impact", "--impact-top", "1", "-o",
                  tmp_path / "npu.h5")
    assert res.exit_code == 0, res.output
    assert "(3 impact runs:" in res.output  # nothing fixed (and one rounding off), the largest own error fixed
    monkeypatch.delenv(FAULT_ENV)
    res = run_cli("compare", reference, tmp_path / "npu.h5")
    assert res.exit_code == 1
    assert "fix first: first@0 (forward output): fixing it closes" in res.output
    assert "impact: the 1 largest own errors of 2 flagged calls were fixed (--impact-top 1)" in res.output
    res = run_cli("record", "--model", PLANTED, "--impact", "-o", tmp_path / "x.h5")
    assert res.exit_code == 2
    assert res.output.strip() == "error: --impact ranks the calls a replay flags: give replay too"


def test_an_iteration_of_two_microbatches_is_run_again_whole_for_each_fix(tmp_path, monkeypatch):
    """Gradient accumulation and impact together: each impact run hands out both microbatches' reference batches
    and sums both losses, so the run with nothing fixed lands on the recorded iteration (its check is 0) and the
    one fault, in both microbatches, closes the gap."""
    def loop(bundle, rec_of, out, **kw):
        model, opt = bundle.model, build_optimizer("sgd", bundle.model.parameters())
        x, y = bundle.inputs[0], torch.arange(8) % 10

        def iteration():
            opt.zero_grad(set_to_none=True)
            for rows in (slice(0, 4), slice(4, 8)):  # two microbatches of 4 rows, one step
                xm, ym = rec.inputs(x[rows], y[rows])
                torch.nn.functional.cross_entropy(model(xm), ym).backward()
            opt.step()

        with oneiter.Recorder(model, out, optimizer=opt, **kw) as rec:
            rec_of.append(rec)
            if kw.get("impact"):
                rec.run(iteration)
            else:
                iteration()
        return rec

    clean = load_model(PLANTED, 8, 0)
    loop(clean, [], tmp_path / "ref.h5")
    rec = loop(_planted(monkeypatch), [], tmp_path / "npu.h5", replay=tmp_path / "ref.h5", impact=True)
    # nothing fixed, the weights one rounding off, layers.4's call in each microbatch fixed, both fixed
    assert rec.summary.impact_runs == 5
    with h5py.File(tmp_path / "npu.h5") as f:
        assert f.attrs["microbatches"] == 2 and f["impact"].attrs["check"] == 0.0
    impact = oneiter.compare(tmp_path / "ref.h5", tmp_path / "npu.h5").verdict_obj.impact
    assert sorted((f.module, f.call, f.phase) for f in impact.fixes) == [("layers.4", 0, "forward"),
                                                                        ("layers.4", 1, "forward")]
    assert sum(f.share for f in impact.fixes) == pytest.approx(1.0, abs=0.1)  # each its microbatch's part
    assert impact.every["share"] == pytest.approx(1.0, abs=0.01)
