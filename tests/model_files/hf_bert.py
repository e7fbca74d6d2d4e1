"""A tiny Hugging Face `transformers` BERT sequence classifier from a random config, with dropout and a padding mask.

Inputs are `(input_ids, attention_mask)` (BertForSequenceClassification.forward's first two positional
parameters); the second sample's last two tokens are padding. Dropout 0.1 by default (kwarg `dropout`).
Kwargs: `seq_len` (8), `attn` ("eager", default, so softmax is a functional call; or "sdpa").

Fault targets (env ONEITER_TEST_FAULT, see faultkit), where they live:
- `function:layer_norm`                         `bert.embeddings.LayerNorm` (nn.LayerNorm)
- `function:softmax` (eager), `function:scaled_dot_product_attention` (sdpa)
                                                `bert.encoder.layer.0.attention.self`, own code
- `function:gelu`                               `bert.encoder.layer.0.intermediate.intermediate_act_fn`
- `function_bwd:gelu`                           `bert.encoder.layer.1.intermediate.intermediate_act_fn` (backward
                                                meets the last call first)
                                                (GELUActivation binds F.gelu at construction: patch_functions()
                                                runs first, so it binds the faulty one)
- `class:BertSelfOutput`, `class:BertIntermediate`, `class:BertPooler`, `class:BertLayer`
- `instance:bert.encoder.layer.1.output.dense`, `instance:bert.pooler`, `instance:classifier`
"""

import torch
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401
from transformers import BertConfig, BertForSequenceClassification


def build(batch_size, seq_len=8, dropout=0.1, attn="eager", num_labels=3):
    patch_functions()
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64, num_labels=num_labels,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        attn_implementation=attn)
    model = BertForSequenceClassification(config)
    ids = torch.randint(1, config.vocab_size, (batch_size, seq_len))
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if batch_size > 1 and seq_len > 2:
        mask[1, -2:] = 0
        ids[1, -2:] = config.pad_token_id
    labels = torch.randint(0, num_labels, (batch_size,))
    return (apply_fault(model), (ids, mask),
            lambda out: torch.nn.functional.cross_entropy(out.logits.float(), labels.to(out.logits.device)))
