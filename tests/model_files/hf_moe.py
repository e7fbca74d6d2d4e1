"""A tiny Hugging Face Qwen3-MoE built from a random config (no download), its experts on `torch._grouped_mm`.

`experts_implementation="grouped_mm"` makes each `Qwen3MoeExperts` call (`model.layers.<i>.mlp.experts`, called
with the hidden states, the router's top-k indices and weights) run its expert projections through
`torch.nn.functional.grouped_mm` / `torch._grouped_mm`, which has float32/bf16/fp16 kernels and no float64 one (on
the CPU of torch 2.13 as on CUDA). A float64 calibration rerun of an experts call (and of every call containing
one) therefore fails, as it does for any op on hardware without float64: the probe falls back to a Monte Carlo
estimate of the noise (docs/blame.md). The dimensions are multiples of 8, as the kernel needs (16-byte strides).

Faults (`faultkit`, env ONEITER_TEST_FAULT): `instance:model.layers.0.mlp.experts` (the experts' outputs scaled),
`class:Qwen3MoeExperts`, `function:silu` (the experts' gate activation runs in `...experts.act_fn`).
"""

import torch
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests recording in one process)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def build(batch_size, seq_len=8, hidden=32, layers=2, experts=4):
    patch_functions()
    config = Qwen3MoeConfig(hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=16,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                            num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
                            experts_implementation="grouped_mm")
    model = Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))

    def loss_fn(out):
        logits = out.logits[:, :-1].float()
        labels = ids[:, 1:].reshape(-1).to(logits.device)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)

    return apply_fault(model), (ids,), loss_fn
