"""Tests for the built-in models in `oneiter.models` (registry, torchvision compatibility, training step)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from oneiter import models
from oneiter.errors import ModelError
from oneiter.runtime.modelspec import load_model

BUILTINS = ["llama_tiny", "mobilenet_v2", "resnet18"]
SMALL_ARGS = {
    "resnet18": {"image_size": 32, "num_classes": 10},
    "mobilenet_v2": {"image_size": 32, "num_classes": 10},
    "llama_tiny": {"seq_len": 8, "vocab_size": 32, "dim": 32, "num_layers": 2, "num_heads": 4},
}

# torchvision's resnet18, in state_dict order: "name shape" for convs and fc; "bn name channels" expands to
# weight, bias, running_mean, running_var, num_batches_tracked.
TORCHVISION_RESNET18 = """
conv1.weight 64 3 7 7
bn bn1 64
layer1.0.conv1.weight 64 64 3 3
bn layer1.0.bn1 64
layer1.0.conv2.weight 64 64 3 3
bn layer1.0.bn2 64
layer1.1.conv1.weight 64 64 3 3
bn layer1.1.bn1 64
layer1.1.conv2.weight 64 64 3 3
bn layer1.1.bn2 64
layer2.0.conv1.weight 128 64 3 3
bn layer2.0.bn1 128
layer2.0.conv2.weight 128 128 3 3
bn layer2.0.bn2 128
layer2.0.downsample.0.weight 128 64 1 1
bn layer2.0.downsample.1 128
layer2.1.conv1.weight 128 128 3 3
bn layer2.1.bn1 128
layer2.1.conv2.weight 128 128 3 3
bn layer2.1.bn2 128
layer3.0.conv1.weight 256 128 3 3
bn layer3.0.bn1 256
layer3.0.conv2.weight 256 256 3 3
bn layer3.0.bn2 256
layer3.0.downsample.0.weight 256 128 1 1
bn layer3.0.downsample.1 256
layer3.1.conv1.weight 256 256 3 3
bn layer3.1.bn1 256
layer3.1.conv2.weight 256 256 3 3
bn layer3.1.bn2 256
layer4.0.conv1.weight 512 256 3 3
bn layer4.0.bn1 512
layer4.0.conv2.weight 512 512 3 3
bn layer4.0.bn2 512
layer4.0.downsample.0.weight 512 256 1 1
bn layer4.0.downsample.1 512
layer4.1.conv1.weight 512 512 3 3
bn layer4.1.bn1 512
layer4.1.conv2.weight 512 512 3 3
bn layer4.1.bn2 512
fc.weight 1000 512
fc.bias 1000
"""


def _expected_resnet18_state() -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = []
    for line in TORCHVISION_RESNET18.strip().splitlines():
        words = line.split()
        if words[0] == "bn":
            prefix, channels = words[1], int(words[2])
            for suffix in ("weight", "bias", "running_mean", "running_var"):
                out.append((f"{prefix}.{suffix}", (channels,)))
            out.append((f"{prefix}.num_batches_tracked", ()))
        else:
            out.append((words[0], tuple(int(w) for w in words[1:])))
    return out


def _build(name: str, batch_size: int = 2, **overrides):
    torch.manual_seed(0)
    return models.get_builder(name)(batch_size=batch_size, **{**SMALL_ARGS[name], **overrides})


# --- registry -------------------------------------------------------------------------------------------


def test_list_models_has_the_builtins_sorted_with_descriptions():
    listed = models.list_models()
    assert [name for name, _ in listed] == BUILTINS
    assert all(desc and "\n" not in desc for _, desc in listed)


def test_unknown_model_raises_model_error_naming_the_known_ones():
    with pytest.raises(ModelError) as info:
        models.get_builder("resnet19")
    message = str(info.value)
    assert "\n" not in message and "resnet19" in message
    assert all(name in message for name in BUILTINS)
    assert "path/to/file.py:function" in message


def test_unknown_name_is_not_imported_as_a_python_path():
    with pytest.raises(ModelError):
        models.get_builder("os.path")


def test_importing_the_registry_does_not_import_torch():
    code = "import sys, oneiter.models as m; m.list_models(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_load_model_builds_a_builtin_through_the_registry():
    bundle = load_model("resnet18", batch_size=2, seed=0, model_args={"image_size": 32, "num_classes": 10})
    assert bundle.inputs[0].shape == (2, 3, 32, 32)


def test_bad_model_args_are_rejected():
    with pytest.raises(ModelError):
        load_model("llama_tiny", batch_size=2, model_args={"no_such_arg": 1})
    with pytest.raises(ModelError):
        _build("llama_tiny", dim=30)


# --- torchvision compatibility --------------------------------------------------------------------------


def test_resnet18_state_dict_matches_torchvision():
    model, _, _ = models.get_builder("resnet18")(batch_size=1)
    state = [(key, tuple(value.shape)) for key, value in model.state_dict().items()]
    assert state == _expected_resnet18_state()
    assert len(state) == 122
    assert len(list(model.parameters())) == 62
    assert sum(p.numel() for p in model.parameters()) == 11_689_512


def test_resnet18_blocks_share_one_relu_like_torchvision():
    model, _, _ = _build("resnet18")
    block = model.layer1[0]
    assert isinstance(block.relu, torch.nn.ReLU) and block.relu.inplace
    assert [name for name, _ in block.named_children()] == ["conv1", "bn1", "relu", "conv2", "bn2"]


def test_mobilenet_v2_matches_torchvision():
    model, _, _ = models.get_builder("mobilenet_v2")(batch_size=1)
    state = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) == 3_504_872
    assert len(list(model.parameters())) == 158
    assert len(state) == 314
    assert state["features.0.0.weight"] == (32, 3, 3, 3)
    assert state["features.1.conv.0.0.weight"] == (32, 1, 3, 3)
    assert state["features.1.conv.1.weight"] == (16, 32, 1, 1)
    assert state["features.2.conv.0.0.weight"] == (96, 16, 1, 1)
    assert state["features.17.conv.2.weight"] == (320, 960, 1, 1)
    assert state["features.18.1.running_var"] == (1280,)
    assert state["classifier.1.weight"] == (1000, 1280)
    assert isinstance(model.classifier[0], torch.nn.Dropout) and model.classifier[0].p == 0.2
    assert isinstance(model.features[0][2], torch.nn.ReLU6)


# --- training step --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_builder_contract_and_training_step(name):
    model, inputs, loss_fn = _build(name)
    assert isinstance(model, torch.nn.Module) and model.training
    assert isinstance(inputs, tuple) and all(t.device.type == "cpu" for t in inputs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loss = loss_fn(model(*inputs))
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", BUILTINS)
def test_builders_are_reproducible_from_the_seed(name):
    model_a, inputs_a, _ = _build(name)
    model_b, inputs_b, _ = _build(name)
    assert all(torch.equal(a, b) for a, b in zip(inputs_a, inputs_b, strict=True))
    for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", BUILTINS)
def test_loss_is_float32_for_bfloat16_output(name):
    model, inputs, loss_fn = _build(name)
    model = model.to(torch.bfloat16)
    inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)
    output = model(*inputs)
    assert output.dtype == torch.bfloat16
    loss = loss_fn(output)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


# --- llama ----------------------------------------------------------------------------------------------


def test_llama_tiny_structure_and_defaults():
    model, (tokens,), _ = models.get_builder("llama_tiny")(batch_size=2)
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 32)
    assert int(tokens.max()) < 256
    state = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert state["tok_embeddings.weight"] == (256, 64)
    assert state["layers.1.attention.wq.weight"] == (64, 64)
    assert state["layers.0.feed_forward.w1.weight"] == (192, 64)
    assert state["layers.0.feed_forward.w2.weight"] == (64, 192)
    assert state["layers.0.attention_norm.weight"] == (64,)
    assert state["norm.weight"] == (64,) and state["output.weight"] == (256, 64)
    assert "layers.0.attention.wq.bias" not in state
    assert model.layers[0].attention.attn_dropout is None
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())


def test_llama_tiny_dropout_adds_attn_dropout():
    model, _, _ = _build("llama_tiny", dropout=0.1)
    assert isinstance(model.layers[0].attention.attn_dropout, torch.nn.Dropout)


def test_llama_tiny_is_causal():
    model, (tokens,), _ = _build("llama_tiny")
    model.eval()
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % SMALL_ARGS["llama_tiny"]["vocab_size"]
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5], rtol=0, atol=0)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_llama_tiny_runs_under_autocast():
    model, inputs, loss_fn = _build("llama_tiny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(*inputs)
        loss = loss_fn(output)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
