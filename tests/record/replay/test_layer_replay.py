"""replay: one recorded layer, run alone from its recorded inputs and weights, reproduces its recording on CPU."""

from __future__ import annotations

import json
import shutil

import h5py
import pytest
import typer
from conftest import record_small
from typer.testing import CliRunner

from oneiter.cli import replay_cmd
from oneiter.errors import OneIterError
from oneiter.format.layout import IterationFile
from oneiter.judge.replayed.layer_verdict import replay_layer
from oneiter.record.replay.layer_replay import _rebuild, _unflatten


def run_cli(*args):
    app = typer.Typer(rich_markup_mode="rich", pretty_exceptions_enable=False)

    @app.callback()
    def _group() -> None:
        """A group, so the command is invoked by name as under `oneiter`."""

    replay_cmd.register(app)
    return CliRunner().invoke(app, ["replay", *map(str, args)])


def names(result) -> list[str]:
    return [c.name for c in result.checks]


def test_conv_layer_reproduces_output_and_gradients_bitwise(resnet_ref):
    result = replay_layer(resnet_ref, "layer1.0.conv1")
    assert (result.key, result.class_name, result.device) == ("layer1.0.conv1@0", "Conv2d", "cpu")
    assert names(result) == ["output", "grad_input.0", "param_grad.weight"]
    assert result.bitwise and result.matched
    assert all(c.max_abs == 0.0 and c.rel_l2 == 0.0 and c.dtype == "float32" for c in result.checks)
    assert result.checks[0].shape == (2, 64, 8, 8)


def test_batchnorm_layer_reproduces_bitwise_in_train_mode(resnet_ref):
    result = replay_layer(resnet_ref, "layer1.0.bn1")
    assert names(result) == ["output", "grad_input.0", "param_grad.weight", "param_grad.bias"]
    assert result.bitwise


def test_second_call_of_a_shared_inplace_relu(resnet_ref):
    """BasicBlock calls its one ReLU(inplace=True) twice; call 1 has its own inputs and gradients."""
    result = replay_layer(resnet_ref, "layer1.0.relu", call=1)
    assert names(result) == ["output", "grad_input.0"]  # no parameters: nothing else to attribute
    assert result.bitwise
    res = run_cli(resnet_ref, "--layer", "layer1.0.relu", "--call", "1")
    assert res.exit_code == 0, res.output
    assert "layer1.0.relu@1 (ReLU)" in res.stdout and "bitwise" in res.stdout


def test_composite_block_and_root_reproduce_bitwise(resnet_ref):
    assert replay_layer(resnet_ref, "layer2.0").bitwise
    root = replay_layer(resnet_ref, "(root)")
    assert root.key == "(root)@0" and root.bitwise and len(root.checks) == 1 + 62  # output + every param grad


def test_transformer_block_gradients_reproduce_bitwise(references):
    """A block whose input feeds several recorded modules: the recorder's alias views set the order in which
    autograd sums the input's gradient, and the replay mirrors them (else last-bit differences)."""
    result = replay_layer(references("llama_tiny"), "layers.0")
    assert "grad_input.0" in names(result) and "param_grad.attention.wq.weight" in names(result)
    assert result.bitwise, [(c.name, c.max_abs) for c in result.checks if not c.bitwise]


def test_repeat_gives_one_timing_per_run(resnet_ref, tmp_path):
    result = replay_layer(resnet_ref, "layer1.0.conv1", repeat=3)
    assert len(result.forward_seconds) == 3 and len(result.backward_seconds) == 3
    assert all(t > 0 for t in result.forward_seconds + result.backward_seconds)
    assert set(result.timing()) == {"forward", "backward"}
    report = tmp_path / "r.json"
    res = run_cli(resnet_ref, "-l", "layer1.0.conv1", "-r", "3", "--json", report)
    assert res.exit_code == 0, res.output
    assert "time per run (3 runs, cpu): forward median" in res.stdout
    data = json.loads(report.read_text())
    assert data["matched"] and data["bitwise"] and data["key"] == "layer1.0.conv1@0"
    assert len(data["forward_seconds"]) == 3 and [c["name"] for c in data["checks"]][0] == "output"


def test_unknown_layer_is_one_line_exit_2(resnet_ref):
    res = run_cli(resnet_ref, "--layer", "layer1.0.conv9")
    assert res.exit_code == 2
    message = res.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in res.output
    assert "no recorded module 'layer1.0.conv9'" in message and "layer1.0.conv1" in message


def test_unrecorded_call_index_is_exit_2_naming_the_recorded_calls(resnet_ref):
    res = run_cli(resnet_ref, "--layer", "layer1.0.relu", "--call", "2")
    assert res.exit_code == 2
    assert "recorded calls are 0, 1" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with pytest.raises(OneIterError, match="no call 1"):
        replay_layer(resnet_ref, "layer1.0.conv1", call=1)


def test_bad_inputs_are_exit_2(resnet_ref, tmp_path):
    assert run_cli(tmp_path / "missing.h5", "-l", "fc").exit_code == 2
    assert run_cli(resnet_ref, "-l", "fc", "--repeat", "0").exit_code == 2
    assert run_cli(resnet_ref).exit_code == 2  # --layer is required
    res = run_cli(resnet_ref, "-l", "fc", "--json", resnet_ref)
    assert res.exit_code == 2 and "would overwrite the input recording" in res.stderr


def test_a_layer_that_differs_from_its_recording_is_exit_1(resnet_ref, tmp_path):
    tampered = tmp_path / "tampered.h5"
    shutil.copy(resnet_ref, tampered)
    with h5py.File(tampered, "r+") as f:
        dset = f["calls/layer1.0.conv1@0/forward/output"]
        dset[0, 0, 0, 0] = dset[0, 0, 0, 0] + 1.0
    res = run_cli(tampered, "-l", "layer1.0.conv1")
    assert res.exit_code == 1, res.output
    assert "DIVERGED" in res.stdout and "beyond tolerance: output" in res.stdout
    result = replay_layer(tampered, "layer1.0.conv1")
    output = result.checks[0]
    assert not output.bitwise and not output.matched and output.max_abs == pytest.approx(1.0, rel=1e-6)
    assert all(c.bitwise for c in result.checks[1:])  # gradients are replayed from their own recorded inputs


def test_replay_leaves_the_recording_and_the_global_rng_alone(resnet_ref):
    import torch

    with IterationFile(resnet_ref) as f:
        before = f.tensor("calls/layer1.0.relu@1/forward/input.0").clone()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    replay_layer(resnet_ref, "layer1.0.relu", call=1, repeat=2)
    assert torch.equal(torch.rand(3), expected)
    with IterationFile(resnet_ref) as f:
        assert torch.equal(f.tensor("calls/layer1.0.relu@1/forward/input.0"), before)


def test_flattened_arguments_are_rebuilt():
    tree = _unflatten({"input.0": "a", "input.1.0": 1, "input.1.1": 2, "kwarg.mask": None, "kwarg.opts.k": 3})
    assert _rebuild(tree["input"], "input") == ["a", [1, 2]]
    assert _rebuild(tree["kwarg"]["opts"], "kwarg.opts") == {"k": 3}
    with pytest.raises(OneIterError, match=r"'input\.1' was not recorded"):
        _rebuild(_unflatten({"input.0": "a", "input.2": "b"})["input"], "input")


MIX_MODEL = '''
import torch
from torch import nn


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, pair, *, scale=1.0, mask=None, mode="a"):
        y = self.lin(x) * scale + pair[0] - pair[1]
        if mask is not None:
            y = y * mask
        return (y, {"aux": y.sum(-1)}) if mode == "a" else y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.mix = Mix()

    def forward(self, x):
        h = self.pre(x)
        y, extra = self.mix(h, [h * 2, h.relu()], scale=0.5, mask=torch.ones_like(h), mode="a")
        return y + extra["aux"][:, None]


def build(batch_size):
    return Net(), (torch.randn(batch_size, 4),), lambda out: out.square().mean()
'''


def test_kwargs_list_arguments_and_dict_outputs_are_rebuilt(tmp_path, monkeypatch):
    """`mix(h, [a, b], scale=0.5, mask=m, mode="a")` -> (y, {"aux": ...}): forward reproduces bitwise; its `aux`
    output is computed from `y`, so the recorded output gradients overlap and the replay says so."""
    (tmp_path / "mix_model.py").write_text(MIX_MODEL)
    monkeypatch.chdir(tmp_path)  # the file stores the model spec as given
    record_small(tmp_path / "mix.h5", "mix_model.py:build", batch_size=3)
    result = replay_layer(tmp_path / "mix.h5", "mix", model="mix_model.py:build")  # a model file is named
    by_name = {c.name: c for c in result.checks}
    assert by_name["output.0"].bitwise and by_name["output.1.aux"].bitwise
    assert result.notes and "output.1.aux is computed from output.0" in result.notes[0]
    lin = replay_layer(tmp_path / "mix.h5", "mix.lin", model="mix_model.py:build")
    assert lin.bitwise and not lin.notes


def test_inputs_get_the_strides_the_live_call_saw(tmp_path, monkeypatch):
    """`blocks.0.fc` was handed a transposed slice (storage offset 8): the replay gives its input that layout
    back, so a kernel wrong only for strided inputs (faultkit's `stride:linear`) fails the replay too."""
    from conftest import FAULT_ENV, MODEL_FILES

    spec = str(MODEL_FILES / "strided.py:build")
    ref = tmp_path / "strided.h5"
    record_small(ref, spec)
    with IterationFile(ref) as f:
        attrs = f.attrs("calls/blocks.0.fc@0/forward/input.0")
    assert (attrs["stride"], attrs["storage_offset"]) == ([56, 1, 8], 8)
    clean = replay_layer(ref, "blocks.0.fc", model=spec)
    assert clean.matched and clean.checks[0].bitwise and clean.checks[1].bitwise  # output, grad_input.0
    monkeypatch.setenv(FAULT_ENV, "stride:linear")
    result = replay_layer(ref, "blocks.0.fc", model=spec)
    output = result.checks[0]
    assert output.name == "output" and not output.matched and output.rel_l2 == pytest.approx(1e-3, rel=1e-3)


def test_dropout_takes_the_reference_values_and_reproduces(files):
    """The MLP of tests/format/mutants.py ends in Dropout(0.25): its mask is the reference's, so it is bitwise."""
    from pathlib import Path

    import mutants

    result = replay_layer(files[0], "3", model=f"{Path(mutants.__file__).resolve()}:build")
    assert result.class_name == "Dropout" and result.bitwise and not result.notes
