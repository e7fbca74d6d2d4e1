"""Hugging Face models that read one of their own outputs, from tiny random configs, faultable from inside.

An encoder-decoder returns its encoder's last hidden state (`encoder_last_hidden_state`) and reads it in every
decoder layer's cross-attention; Wav2Vec2 returns `extract_features`, the normalised features its projection reads.
The gradient such an output receives is the sum of what its readers hand back, computed inside the model.

`build(batch_size, name="t5" | "bart" | "wav2vec2", layers=3, loss="token" | "flat")`: `token` is cross entropy on
an encoder-decoder's logits (Wav2Vec2: the mean square of its last hidden state against a random target); `flat`
is the squared mean of the base model's last hidden state, which a normalisation ends: it is 1 whatever the input in
exact arithmetic, so every gradient upstream of that norm is rounding. Faults: `faultkit` (ONEITER_TEST_FAULT),
e.g. `instance:decoder.block.1.layer.1.EncDecAttention.k:0.05` (T5's second decoder layer's cross-attention `k`).
"""

import torch
import torch.nn.functional as F
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests)

VOCAB, SEQ, TARGET = 96, 8, 6


def _flat(out):
    hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out).float()
    return hidden.pow(2).mean()


def _token(labels):
    def loss_fn(out):
        logits = out.logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return loss_fn


def _mse(target):
    return lambda out: F.mse_loss(out.last_hidden_state.float(), target.expand_as(out.last_hidden_state))


def _text(transformers, name: str, layers: int, flat: bool):
    common = dict(vocab_size=VOCAB, use_cache=False, attn_implementation="eager", decoder_start_token_id=0,
                  pad_token_id=0)
    if name == "t5":
        config = transformers.T5Config(d_model=32, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                                       num_heads=4, d_kv=8, relative_attention_num_buckets=8, dropout_rate=0.0,
                                       **common)
        return (transformers.T5Model if flat else transformers.T5ForConditionalGeneration)(config)
    config = transformers.BartConfig(d_model=32, encoder_layers=layers, decoder_layers=layers,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, **common)
    return (transformers.BartModel if flat else transformers.BartForConditionalGeneration)(config)


def build(batch_size, name="t5", layers=3, loss="token"):
    import transformers

    patch_functions()
    flat = loss == "flat"
    if name == "wav2vec2":
        config = transformers.Wav2Vec2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, conv_dim=(16, 16),
            conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
            vocab_size=VOCAB, attn_implementation="eager")
        model = transformers.Wav2Vec2Model(config)
        inputs = (torch.randn(batch_size, 400),)
        loss_fn = _flat if flat else _mse(torch.randn(32))
    else:
        model = _text(transformers, name, layers, flat)
        ids = torch.randint(1, VOCAB, (batch_size, SEQ))
        inputs = (ids, torch.ones_like(ids), torch.randint(1, VOCAB, (batch_size, TARGET)))
        loss_fn = _flat if flat else _token(torch.randint(0, VOCAB, (batch_size, TARGET)))
    return apply_fault(model), inputs, loss_fn
