"""A tiny Hugging Face `transformers` Llama built from a random config (no download), faultable from inside.

Hugging Face calls the decoder layers and attention modules with keyword arguments (`hidden_states=`,
`attention_mask=`, `position_embeddings=(cos, sin)`, ...) and keeps the attention math (rotary, sdpa) as
functional code inside `LlamaAttention.forward`. Faults (`faultkit`, env ONEITER_TEST_FAULT), for example:
`function:silu` (lives in `model.layers.0.mlp.act_fn`), `function:scaled_dot_product_attention`
(`model.layers.0.self_attn`, own code), `class:LlamaRMSNorm` (`model.layers.0.input_layernorm`),
`instance:model.layers.1.mlp.down_proj`, `instance:model.layers.0.self_attn` (called with keywords).
`checkpointing="non_reentrant"` or `"reentrant"` turns on Hugging Face's activation checkpointing of every decoder
layer (`gradient_checkpointing_enable`); `dropout` is the attention's dropout probability.

`build_steps` is the same model with the model contract's fifth item, `batch(step)`: a new batch each iteration
whose token ids stay below `RARE` (90) except in step `rare_step` (6), which first holds ids 90..99 — what the
fault `ids:90` (`faultkit`) gets wrong. No optimizer of its own (`--optimizer` builds it).
"""

import torch
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests recording in one process)
from transformers import LlamaConfig, LlamaForCausalLM


def build(batch_size, seq_len=8, use_cache=False, attn="sdpa", hidden=32, layers=2, checkpointing="", dropout=0.0):
    patch_functions()
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                         use_cache=use_cache, attn_implementation=attn, attention_dropout=float(dropout))
    model = LlamaForCausalLM(config)
    if checkpointing:
        if checkpointing not in ("reentrant", "non_reentrant"):
            raise ValueError(f"checkpointing must be reentrant or non_reentrant, got {checkpointing!r}")
        # transformers 5.x's name for `gradient_checkpointing_enable` (deprecated there, the only one in 4.x)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": checkpointing == "reentrant"})
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))

    def loss_fn(out):
        logits = out.logits[:, :-1].float()
        labels = ids[:, 1:].reshape(-1).to(logits.device)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)

    return apply_fault(model), (ids,), loss_fn


RARE = 90


def build_steps(batch_size, seq_len=8, hidden=32, layers=2, rare_step=6, dropout=0.0):
    """(model, inputs, loss_fn, None, batch): `batch(step)` depends on the step alone (its own generator)."""
    model, _, _ = build(batch_size, seq_len=seq_len, hidden=hidden, layers=layers, dropout=dropout)

    def batch(step):
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, RARE, (batch_size, seq_len), generator=gen)
        if step == rare_step:  # the rare ids appear for the first time
            ids[:, seq_len // 2] = torch.randint(RARE, 100, (batch_size,), generator=gen)

        def loss_fn(out):
            logits = out.logits[:, :-1].float()
            labels = ids[:, 1:].reshape(-1).to(logits.device)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)

        return (ids,), loss_fn

    inputs, loss_fn = batch(0)
    return model, inputs, loss_fn, None, batch
