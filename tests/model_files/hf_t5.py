"""A tiny Hugging Face `transformers` T5 (encoder-decoder) from a random config, faultable from inside.

Called as `t5(input_ids=..., labels=...)`: the decoder's inputs are the labels shifted right and the loss is
computed inside the model (the root's own code). T5's attention bias is handed from block to block: the first
block of each stack computes `position_bias` from its relative-attention-bias embedding, returns it, and the
stack passes it into every later block, which consumes it and returns it again. Faults (`faultkit`, env
ONEITER_TEST_FAULT), for example: `instance:t5.decoder.block.1.layer.2.DenseReluDense.wo` (a later decoder
block's feed-forward), `class:T5LayerFF`, `function:softmax` (eager attention, in `...layer.0.SelfAttention`'s
own code), `function_bwd:relu` (backward only; `DenseReluDense.act` binds it at construction).
"""

import torch
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401
from transformers import T5Config, T5ForConditionalGeneration


def build(batch_size, seq_len=8, target_len=6, attn="eager"):
    patch_functions()
    config = T5Config(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8, vocab_size=100,
                      relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
                      attn_implementation=attn, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, config.vocab_size, (batch_size, seq_len))
    labels = torch.randint(1, config.vocab_size, (batch_size, target_len))

    class WithLabels(torch.nn.Module):
        """T5 called as `model(input_ids=..., labels=...)`: the loss is computed inside the model."""

        def __init__(self, inner):
            super().__init__()
            self.t5 = inner

        def forward(self, input_ids, labels):
            return self.t5(input_ids=input_ids, labels=labels).loss

    return apply_fault(WithLabels(model)), (ids, labels), lambda loss: loss
