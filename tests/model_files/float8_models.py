"""Models whose Linears run torchao's float8 training, converted by the builder itself (as torchtitan's `float8`
converter does), and faultable from inside.

`float8="tensorwise"` or `"rowwise"` (`--model-arg float8=...`) converts every Linear with both dimensions divisible by
16 with torchao's `convert_to_float8_training`, leaving the Llama's `lm_head` in high precision; `"mxfp8"` swaps every
Linear with both dimensions divisible by 32 for torchao's `MXFP8Linear` (MX blocks of 32, RCEIL scales, the emulated
kernels that run on a CPU); "" (the default) leaves the model as it is: the reference. The conversion happens before
faultkit's fault (`ONEITER_TEST_FAULT`), so `instance:model.layers.0.mlp.down_proj` wraps the converted Linear, as a
vendor's wrapper around an FP8 module would.

- `build_mlp`: three Linears (32 -> 64 -> 32 -> 16, with biases) and ReLUs, a classification loss;
- `build_llama`: a tiny Hugging Face Llama from a random config (hidden 32, 2 layers: `hf_llama.py`'s).
"""

import torch
import torch.nn as nn
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests in one process)


def _converted(model, float8: str):
    if not float8:
        return model
    if float8 == "mxfp8":
        return _mx(model)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def wanted(module, fqn):
        return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0

    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8),
                                      module_filter_fn=wanted)


def _mx(model):
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module.in_features % 32 == 0 and module.out_features % 32 == 0:
            mx = MXFP8Linear(module.in_features, module.out_features, bias=module.bias is not None,
                             kernel_preference=KernelPreference.EMULATED)
            mx.weight, mx.bias = module.weight, module.bias
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, mx)
    return model


def build_mlp(batch_size, float8=""):
    patch_functions()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    x, y = torch.randn(batch_size, 32), torch.randint(0, 16, (batch_size,))
    model = apply_fault(_converted(model, float8))
    return model, (x,), lambda out: nn.functional.cross_entropy(out.float(), y.to(out.device))


def build_llama(batch_size, float8="", seq_len=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    patch_functions()
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))

    def loss_fn(out):
        logits = out.logits[:, :-1].float()
        labels = ids[:, 1:].reshape(-1).to(logits.device)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)

    return apply_fault(_converted(model, float8)), (ids,), loss_fn
