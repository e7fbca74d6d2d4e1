"""A tiny Hugging Face `transformers` GPT-2 from a random config, with dropout, faultable from inside.

GPT-2's blocks hold dropout (attention, residual, embedding): the local probes rerun them with the reference's
random masks. Its loss is computed inside the model (`labels=`), i.e. in the root's own code. Faults
(`faultkit`, env ONEITER_TEST_FAULT), for example: `function:softmax` (eager attention: `transformer.h.0.attn`'s
own code), `function:gelu` (`transformer.h.0.mlp.act`), `class:GPT2MLP` (`transformer.h.0.mlp`),
`instance:transformer.h.1.attn.c_proj`, `function_bwd:gelu` (backward only), `function:cross_entropy` (the loss,
in the root's own code).
"""

import torch
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401
from transformers import GPT2Config, GPT2LMHeadModel


def build(batch_size, seq_len=8, dropout=0.1):
    patch_functions()
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, activation_function="gelu",
                        attn_implementation="eager", use_cache=False, bos_token_id=0, eos_token_id=0,
                        loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))

    class WithLabels(torch.nn.Module):
        """GPT-2 called as `model(input_ids=..., labels=...)`: the loss is computed inside the model."""

        def __init__(self, inner):
            super().__init__()
            self.gpt = inner

        def forward(self, input_ids):
            return self.gpt(input_ids=input_ids, labels=input_ids).loss

    return apply_fault(WithLabels(model)), (ids,), lambda loss: loss
