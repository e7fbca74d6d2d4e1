"""The zoo: model code nobody on this project wrote, built from tiny configs with random init (no download).

`build(batch_size, name)` returns `(model, inputs, loss_fn)` of the zoo model `name` (`MODELS`): a Hugging Face
`transformers` architecture from a tiny random config, a stock `torch.nn` family, or torchtitan's Llama (where
the `torchtitan` package imports). The model is called as `model(*inputs)`, positionally, the way the model
contract calls it; the loss is computed outside the model from what it returns (`logits` against random labels,
or the mean square of a base model's `last_hidden_state` against a random target), so every other tensor the
model returns (BART's `encoder_last_hidden_state`, Wav2Vec2's `extract_features`) is returned and not consumed.

Faults come from `faultkit` (env ONEITER_TEST_FAULT, read in the builder, never through oneiter):
`instance:<path>` / `instance_bwd:<path>` (a module's output, or only its gradient, scaled) and
`function:<name>` / `function_bwd:<name>` (a `torch.nn.functional` function wrong, forward or backward).
`bench/zoo.py` chooses the site by a rule and runs the sweep; `tests/judge/iteration/test_zoo.py` runs a subset in CI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, patch_functions, undo_faults  # noqa: F401  (undo_faults: for in-process runs)

__all__ = ["MODELS", "Entry", "build", "families"]

VOCAB, SEQ, HIDDEN = 96, 8, 32


@dataclass(frozen=True)
class Entry:
    """One zoo model: its family (what it stands for) and how to make `(model, inputs, loss_fn)`."""

    family: str
    make: Callable[[int], tuple]
    source: str = "hf"  # hf, torch.nn, torchtitan


def build(batch_size, name: str = "llama"):
    """The zoo model `name`, with the fault ONEITER_TEST_FAULT asks for (faultkit)."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; one of {', '.join(MODELS)}")
    patch_functions()
    model, inputs, loss_fn = MODELS[name].make(batch_size)
    return apply_fault(model), inputs, loss_fn


def families() -> dict[str, list[str]]:
    """family -> the zoo models standing for it, in catalogue order."""
    out: dict[str, list[str]] = {}
    for name, entry in MODELS.items():
        out.setdefault(entry.family, []).append(name)
    return out


# -- losses ---------------------------------------------------------------------------------------------------------

def _token_loss(labels):
    """Cross entropy of every position's logits against `labels` (computed outside the model)."""

    def loss_fn(out):
        logits = (out.logits if hasattr(out, "logits") else out).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device))

    return loss_fn


def _hidden_loss(target):
    """Mean square of a base model's last hidden state against a random target."""

    def loss_fn(out):
        hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out).float()
        return F.mse_loss(hidden, target.to(hidden.device).expand_as(hidden))

    return loss_fn


def _ids(batch_size, seq=SEQ, vocab=VOCAB):
    return torch.randint(1, vocab, (batch_size, seq))


# -- Hugging Face ---------------------------------------------------------------------------------------------------

TEXT = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
            tie_word_embeddings=False)


def _config(config_cls, base: dict, extra: dict):
    """`config_cls` with the keys of `base` it knows and every key of `extra` (which may add its own)."""
    known = set(config_cls().to_dict())
    kwargs = {k: v for k, v in base.items() if k in known}
    kwargs.update(extra)
    return config_cls(**kwargs)


def _hf(config: str, model: str):
    """The config and model classes named (transformers imports them lazily, on first use)."""
    import transformers

    return getattr(transformers, config), getattr(transformers, model)


def causal_lm(config: str, model: str, **extra):
    def make(batch_size):
        config_cls, model_cls = _hf(config, model)
        cfg = _config(config_cls, TEXT, {"attn_implementation": "eager", **extra})
        net = model_cls(cfg)
        ids = _ids(batch_size)
        return net, (ids,), _token_loss(torch.randint(0, VOCAB, (batch_size, SEQ)))

    return make


def masked_lm(config: str, model: str, **extra):
    def make(batch_size):
        config_cls, model_cls = _hf(config, model)
        cfg = _config(config_cls, TEXT, {"attn_implementation": "eager", **extra})
        net = model_cls(cfg)
        ids = _ids(batch_size)
        return net, (ids, torch.ones_like(ids)), _token_loss(torch.randint(0, VOCAB, (batch_size, SEQ)))

    return make


def seq2seq(config: str, model: str, target_len: int = 6, **extra):
    def make(batch_size):
        config_cls, model_cls = _hf(config, model)
        cfg = _config(config_cls, TEXT, {"attn_implementation": "eager", "decoder_start_token_id": 0, **extra})
        net = model_cls(cfg)
        ids, dec = _ids(batch_size), _ids(batch_size, target_len)
        return net, (ids, torch.ones_like(ids), dec), _token_loss(torch.randint(0, VOCAB, (batch_size, target_len)))

    return make


VISION = dict(image_size=32, num_channels=3, num_labels=5, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
              num_hidden_layers=2, num_attention_heads=4, patch_size=8)


def image_classifier(config: str, model: str, image_size: int = 32, **extra):
    def make(batch_size):
        config_cls, model_cls = _hf(config, model)
        cfg = _config(config_cls, {**VISION, "image_size": image_size}, extra)
        net = model_cls(cfg)
        pixels = torch.randn(batch_size, 3, image_size, image_size)
        return net, (pixels,), _token_loss(torch.randint(0, cfg.num_labels, (batch_size,)))

    return make


SPEECH = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=4,
              conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=8,
              num_conv_pos_embedding_groups=4, vocab_size=VOCAB)


def speech_base(config: str, model: str, samples: int = 400, **extra):
    def make(batch_size):
        config_cls, model_cls = _hf(config, model)
        cfg = _config(config_cls, SPEECH, {"attn_implementation": "eager", **extra})
        net = model_cls(cfg)
        audio = torch.randn(batch_size, samples)
        return net, (audio,), _hidden_loss(torch.randn(HIDDEN))

    return make


def whisper(**extra):
    """Whisper: log-mel features through a convolutional front end into an encoder, and a decoder."""

    def make(batch_size):
        config_cls, model_cls = _hf("WhisperConfig", "WhisperForConditionalGeneration")
        cfg = _config(config_cls, TEXT, {"attn_implementation": "eager", "decoder_start_token_id": 0, **extra})
        frames = 2 * cfg.max_source_positions
        features, dec = torch.randn(batch_size, cfg.num_mel_bins, frames), _ids(batch_size, 6)
        mask = torch.ones(batch_size, frames, dtype=torch.long)
        return model_cls(cfg), (features, mask, dec), _token_loss(torch.randint(0, VOCAB, (batch_size, 6)))

    return make


# -- stock torch.nn -------------------------------------------------------------------------------------------------

class _Classify(nn.Module):
    """A stock body between an embedding of token ids and a linear head."""

    def __init__(self, body: nn.Module, width: int = HIDDEN, call: Callable | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.body = body
        self.head = nn.Linear(width, VOCAB)
        self._call = call

    def forward(self, ids):
        h = self.embed(ids)
        h = self._call(self.body, h) if self._call is not None else self.body(h)
        return self.head(h)


def _tokens(model_fn: Callable[[], nn.Module]):
    def make(batch_size):
        model = model_fn()
        ids = _ids(batch_size)
        return model, (ids,), _token_loss(torch.randint(0, VOCAB, (batch_size, SEQ)))

    return make


def _encoder(norm_first: bool):
    layer = nn.TransformerEncoderLayer(HIDDEN, 4, 2 * HIDDEN, dropout=0.0, batch_first=True, norm_first=norm_first)
    return _Classify(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False))


class _Decoder(nn.Module):
    """nn.TransformerDecoder over token embeddings, its memory a second embedding of the same ids."""

    def __init__(self, norm_first: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.memory = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerDecoderLayer(HIDDEN, 4, 2 * HIDDEN, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.decoder(self.embed(ids), self.memory(ids), tgt_mask=mask, tgt_is_causal=True))


class _Seq2Seq(nn.Module):
    """The full nn.Transformer (encoder and decoder stacks)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.transformer = nn.Transformer(HIDDEN, 4, 2, 2, 2 * HIDDEN, dropout=0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, src, tgt):
        return self.head(self.transformer(self.embed(src), self.embed(tgt)))


class _SelfAttention(nn.Module):
    """nn.MultiheadAttention called by hand: `attn(h, h, h)` (self) or `attn(h, m, m)` (cross, key = value)."""

    def __init__(self, cross: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)
        self.mem = nn.Linear(HIDDEN, HIDDEN) if cross else None
        self.ff = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        if self.mem is None:
            a, _ = self.attn(h, h, h)
        else:
            m = self.mem(h)
            a, _ = self.attn(h, m, m)
        h = h + a
        return self.head(h + self.ff(h))


class _Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
        self.rnn = cls(HIDDEN, HIDDEN, num_layers=2, batch_first=True, bidirectional=kind != "rnn")
        self.proj = nn.Linear(HIDDEN * (1 if kind == "rnn" else 2), HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(torch.tanh(self.proj(out)))


def _images(model_fn: Callable[[], nn.Module], shape: tuple, classes: int = 5):
    def make(batch_size):
        model = model_fn()
        x = torch.randn(batch_size, *shape)
        return model, (x,), _token_loss(torch.randint(0, classes, (batch_size,)))

    return make


def _conv1d():
    return nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.Conv1d(8, 8, 3, stride=2),
                         nn.GroupNorm(2, 8), nn.SiLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 5))


def _conv2d():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                         nn.MaxPool2d(2), nn.Conv2d(16, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 5))


def _conv3d():
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True), nn.LeakyReLU(),
                         nn.Conv3d(4, 8, 3, stride=2), nn.BatchNorm3d(8), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                         nn.Flatten(), nn.Linear(8, 5))


class _ConvTranspose(nn.Module):
    """An encoder-decoder of convolutions and transposed convolutions (1d and 2d), the loss on a pooled output."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), nn.Tanh())
        self.line = nn.ConvTranspose1d(4, 4, 3, stride=2)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        h = self.up(self.down(x))  # b x 4 x 16 x 16
        h = self.line(h.flatten(2))  # b x 4 x L
        return self.head(h.mean(-1))


class _Norms(nn.Module):
    """Batch, group, instance and layer norms in a row, over a 2d feature map."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(4, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.ln = nn.LayerNorm(8)
        self.mid = nn.Linear(8, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.inorm(self.gn(torch.relu(self.bn(self.conv(x)))))
        h = self.ln(h.mean((2, 3)))
        return self.head(self.bn1(self.mid(h)))


class _Embeddings(nn.Module):
    """nn.Embedding with max_norm (renormalises the rows it looks up, in place, in forward) and padding_idx, and
    nn.EmbeddingBag with max_norm."""

    def __init__(self, bag: bool):
        super().__init__()
        self.bag = bag
        self.embed = nn.Embedding(VOCAB, HIDDEN, padding_idx=0, max_norm=1.0)
        self.pooled = nn.EmbeddingBag(VOCAB, HIDDEN, mode="mean", max_norm=1.0) if bag else None
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        if self.pooled is not None:
            h = h + self.pooled(ids).unsqueeze(1)
        return self.head(torch.tanh(self.mid(h)))


def _padded_ids(batch_size):
    ids = _ids(batch_size)
    ids[:, -2:] = 0  # padding
    return ids


def _embeddings(bag: bool):
    def make(batch_size):
        ids = _padded_ids(batch_size)
        return _Embeddings(bag), (ids,), _token_loss(torch.randint(0, VOCAB, (batch_size, SEQ)))

    return make


def _parametrized(kind: str):
    def model():
        from torch.nn.utils import parametrizations as P

        wrap = {"weight_norm": P.weight_norm, "spectral_norm": P.spectral_norm, "orthogonal": P.orthogonal}[kind]
        body = nn.Sequential(wrap(nn.Linear(HIDDEN, HIDDEN)), nn.GELU(), wrap(nn.Linear(HIDDEN, HIDDEN)), nn.Tanh(),
                             nn.Linear(HIDDEN, HIDDEN))
        return _Classify(body)

    return model


class _Tied(nn.Module):
    """The output projection shares the embedding's weight (an LM's tied weights): one parameter, two modules."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.out(self.norm(h + self.mix(h)))


def _inplace():
    acts = (nn.ReLU(inplace=True), nn.Hardswish(inplace=True), nn.LeakyReLU(0.1, inplace=True), nn.SiLU(inplace=True),
            nn.Dropout(0.1, inplace=True))
    return _Classify(nn.Sequential(*(m for act in acts for m in (nn.Linear(HIDDEN, HIDDEN), act)),
                                   nn.Linear(HIDDEN, HIDDEN)))


def _seq2seq_ids(batch_size):
    src, tgt = _ids(batch_size), _ids(batch_size, 6)
    return _Seq2Seq(), (src, tgt), _token_loss(torch.randint(0, VOCAB, (batch_size, 6)))


# -- torchtitan -----------------------------------------------------------------------------------------------------

def torchtitan_llama(batch_size):
    """torchtitan's Llama 3 as its package ships it: fused QKV (`qkv_linear.wqkv`, a parameter that its
    state_dict hooks split into `wq`/`wk`/`wv`), complex RoPE, RMSNorm, SwiGLU; its own initialisation. The inner
    attention is its SDPA module: its default for language models (flex attention) has no CPU backward."""
    from torchtitan.models import llama3  # needs triton to import, even on a CPU
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    heads = 4
    rope = ComplexRoPE.Config(dim=HIDDEN // heads, max_seq_len=64, theta=500000, scaling="llama")
    layers = llama3._build_llama3_layers(fuse_qkv=True, n_layers=2, dim=HIDDEN, n_heads=heads, n_kv_heads=2,
                                         hidden_dim=compute_ffn_hidden_dim(HIDDEN, multiple_of=16), rope=rope,
                                         attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=llama3._output_linear_init(HIDDEN)))
    net = config.build()
    net.init_states()
    ids = _ids(batch_size)
    return net, (ids,), _token_loss(torch.randint(0, VOCAB, (batch_size, SEQ)))


# multi-head latent attention (DeepSeek): compressed q and kv, a rotary part of each head; 4 routed experts
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)

# -- the catalogue --------------------------------------------------------------------------------------------------

LM = "decoder LM"
MODELS: dict[str, Entry] = {
    # decoder LMs: dense
    "llama": Entry(f"{LM}: dense", causal_lm("LlamaConfig", "LlamaForCausalLM")),
    "qwen3": Entry(f"{LM}: dense, qk-norm", causal_lm("Qwen3Config", "Qwen3ForCausalLM")),
    "gpt2": Entry(f"{LM}: dense, absolute positions", causal_lm(
        "GPT2Config", "GPT2LMHeadModel", n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)),
    "opt": Entry(f"{LM}: dense, absolute positions", causal_lm(
        "OPTConfig", "OPTForCausalLM", ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN)),
    "gpt_bigcode": Entry(f"{LM}: dense, multi-query", causal_lm(
        "GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB,
        n_positions=64, multi_query=True)),
    "mistral": Entry(f"{LM}: sliding window", causal_lm("MistralConfig", "MistralForCausalLM", sliding_window=4)),
    "gemma2": Entry(f"{LM}: soft-capping, sliding window", causal_lm(
        "Gemma2Config", "Gemma2ForCausalLM", sliding_window=4, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0)),
    "bloom": Entry(f"{LM}: ALiBi", causal_lm("BloomConfig", "BloomForCausalLM", n_layer=2, n_head=4)),
    "mpt": Entry(f"{LM}: ALiBi", causal_lm("MptConfig", "MptForCausalLM", d_model=HIDDEN, n_heads=4, n_layers=2,
                                           expansion_ratio=2, max_seq_len=64)),
    "falcon": Entry(f"{LM}: ALiBi, parallel block", causal_lm("FalconConfig", "FalconForCausalLM", alibi=True,
                                                               num_kv_heads=4)),
    "gpt_neox": Entry(f"{LM}: partial rotary", causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.25)),
    "phi": Entry(f"{LM}: partial rotary, parallel block", causal_lm("PhiConfig", "PhiForCausalLM",
                                                                     partial_rotary_factor=0.5)),
    "gptj": Entry(f"{LM}: partial rotary (interleaved)", causal_lm(
        "GPTJConfig", "GPTJForCausalLM", n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    # decoder LMs: mixture of experts, multi-head latent attention
    "mixtral": Entry(f"{LM}: MoE", causal_lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                             num_experts_per_tok=2)),
    "qwen2_moe": Entry(f"{LM}: MoE, shared expert", causal_lm(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32)),
    "deepseek_v3": Entry(f"{LM}: multi-head latent attention, MoE", causal_lm(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", **MLA)),
    # encoders
    "bert": Entry("encoder: absolute positions", masked_lm("BertConfig", "BertForMaskedLM")),
    "albert": Entry("encoder: shared layers", masked_lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=16)),
    "distilbert": Entry("encoder: absolute positions", masked_lm(
        "DistilBertConfig", "DistilBertForMaskedLM", dim=HIDDEN, hidden_dim=2 * HIDDEN, n_layers=2, n_heads=4)),
    "mpnet": Entry("encoder: relative positions", masked_lm("MPNetConfig", "MPNetForMaskedLM")),
    "deberta": Entry("encoder: disentangled attention", masked_lm(
        "DebertaConfig", "DebertaForMaskedLM", relative_attention=True, pos_att_type=["c2p", "p2c"])),
    "deberta_v2": Entry("encoder: disentangled attention", masked_lm(
        "DebertaV2Config", "DebertaV2ForMaskedLM", relative_attention=True, pos_att_type=["c2p", "p2c"],
        position_buckets=8)),
    "roformer": Entry("encoder: rotary positions", masked_lm("RoFormerConfig", "RoFormerForMaskedLM",
                                                             embedding_size=HIDDEN)),
    "modernbert": Entry("encoder: rotary positions, local attention", masked_lm(
        "ModernBertConfig", "ModernBertForMaskedLM", global_attn_every_n_layers=2, local_attention=4)),
    # encoder-decoders
    "t5": Entry("encoder-decoder: relative position bias", seq2seq(
        "T5Config", "T5ForConditionalGeneration", d_model=HIDDEN, d_ff=2 * HIDDEN, num_layers=2, num_heads=4,
        d_kv=8, relative_attention_num_buckets=8, dropout_rate=0.0)),
    "bart": Entry("encoder-decoder: absolute positions", seq2seq(
        "BartConfig", "BartForConditionalGeneration", d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)),
    "pegasus": Entry("encoder-decoder: sinusoidal positions", seq2seq(
        "PegasusConfig", "PegasusForConditionalGeneration", d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)),
    # vision
    "resnet": Entry("vision: CNN", image_classifier("ResNetConfig", "ResNetForImageClassification",
                                                    embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
    "convnext": Entry("vision: CNN", image_classifier("ConvNextConfig", "ConvNextForImageClassification",
                                                      hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
    "regnet": Entry("vision: CNN", image_classifier("RegNetConfig", "RegNetForImageClassification",
                                                    embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                    groups_width=4)),
    "mobilenet_v2": Entry("vision: CNN (depthwise)", image_classifier(
        "MobileNetV2Config", "MobileNetV2ForImageClassification", depth_multiplier=0.25)),
    "vit": Entry("vision: ViT", image_classifier("ViTConfig", "ViTForImageClassification")),
    "beit": Entry("vision: ViT, relative position bias", image_classifier(
        "BeitConfig", "BeitForImageClassification", use_relative_position_bias=True)),
    "dinov2": Entry("vision: ViT", image_classifier("Dinov2Config", "Dinov2ForImageClassification")),
    "swin": Entry("vision: windowed attention, hierarchical", image_classifier(
        "SwinConfig", "SwinForImageClassification", patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
        window_size=4)),
    "segformer": Entry("vision: hierarchical", image_classifier(
        "SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2, depths=[1, 1],
        sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2])),
    # speech
    "wav2vec2": Entry("speech: convolutional front end", speech_base("Wav2Vec2Config", "Wav2Vec2Model")),
    "wavlm": Entry("speech: convolutional front end, gated relative bias", speech_base(
        "WavLMConfig", "WavLMModel", num_buckets=16, max_bucket_distance=32)),
    "wav2vec2_conformer": Entry("speech: conformer", speech_base(
        "Wav2Vec2ConformerConfig", "Wav2Vec2ConformerModel", position_embeddings_type="rotary",
        conv_depthwise_kernel_size=3)),
    "whisper": Entry("speech: encoder-decoder, convolutional front end", whisper(
        d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_mel_bins=16, max_source_positions=16, max_target_positions=32)),
    # state-space and recurrent
    "mamba": Entry("state-space: Mamba", causal_lm("MambaConfig", "MambaForCausalLM", state_size=8, expand=2,
                                                   conv_kernel=4, time_step_rank=4)),
    "mamba2": Entry("state-space: Mamba-2", causal_lm("Mamba2Config", "Mamba2ForCausalLM", state_size=8, expand=2,
                                                      conv_kernel=4, num_heads=8, head_dim=8, n_groups=1,
                                                      chunk_size=4)),
    "rwkv": Entry("recurrent: RWKV", causal_lm("RwkvConfig", "RwkvForCausalLM", attention_hidden_size=HIDDEN,
                                               context_length=64)),
    "jamba": Entry("hybrid: attention + Mamba + MoE", causal_lm(
        "JambaConfig", "JambaForCausalLM", num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4,
        use_mamba_kernels=False)),
    "recurrent_gemma": Entry("hybrid: recurrent (Griffin)", causal_lm(
        "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", lru_width=HIDDEN, attention_window_size=4,
        block_types=["recurrent", "attention"])),
    # stock torch.nn
    "nn_encoder_postln": Entry("torch.nn: TransformerEncoder post-LN", _tokens(lambda: _encoder(False)), "torch.nn"),
    "nn_encoder_preln": Entry("torch.nn: TransformerEncoder pre-LN", _tokens(lambda: _encoder(True)), "torch.nn"),
    "nn_decoder_postln": Entry("torch.nn: TransformerDecoder post-LN", _tokens(lambda: _Decoder(False)),
                               "torch.nn"),
    "nn_decoder_preln": Entry("torch.nn: TransformerDecoder pre-LN", _tokens(lambda: _Decoder(True)), "torch.nn"),
    "nn_transformer": Entry("torch.nn: Transformer (encoder-decoder)", _seq2seq_ids, "torch.nn"),
    "nn_mha_self": Entry("torch.nn: MultiheadAttention, self (q = k = v)", _tokens(lambda: _SelfAttention(False)),
                         "torch.nn"),
    "nn_mha_cross": Entry("torch.nn: MultiheadAttention, cross (k = v)", _tokens(lambda: _SelfAttention(True)),
                          "torch.nn"),
    "nn_lstm": Entry("torch.nn: LSTM", _tokens(lambda: _Recurrent("lstm")), "torch.nn"),
    "nn_gru": Entry("torch.nn: GRU", _tokens(lambda: _Recurrent("gru")), "torch.nn"),
    "nn_rnn": Entry("torch.nn: RNN", _tokens(lambda: _Recurrent("rnn")), "torch.nn"),
    "nn_conv1d": Entry("torch.nn: Conv1d, BatchNorm1d, GroupNorm", _images(_conv1d, (4, 16)), "torch.nn"),
    "nn_conv2d": Entry("torch.nn: Conv2d, BatchNorm2d, in-place ReLU", _images(_conv2d, (3, 16, 16)), "torch.nn"),
    "nn_conv3d": Entry("torch.nn: Conv3d, InstanceNorm3d, BatchNorm3d", _images(_conv3d, (2, 8, 8, 8)), "torch.nn"),
    "nn_conv_transpose": Entry("torch.nn: ConvTranspose1d/2d", _images(_ConvTranspose, (3, 16, 16)), "torch.nn"),
    "nn_norms": Entry("torch.nn: Batch/Group/Instance/LayerNorm", _images(_Norms, (3, 8, 8)), "torch.nn"),
    "nn_embedding": Entry("torch.nn: Embedding (max_norm, padding_idx)", _embeddings(False), "torch.nn"),
    "nn_embedding_bag": Entry("torch.nn: EmbeddingBag (max_norm)", _embeddings(True), "torch.nn"),
    "nn_weight_norm": Entry("torch.nn: weight_norm parametrization", _tokens(_parametrized("weight_norm")),
                            "torch.nn"),
    "nn_spectral_norm": Entry("torch.nn: spectral_norm parametrization", _tokens(_parametrized("spectral_norm")),
                              "torch.nn"),
    "nn_orthogonal": Entry("torch.nn: orthogonal parametrization", _tokens(_parametrized("orthogonal")),
                           "torch.nn"),
    "nn_tied": Entry("torch.nn: tied weights", _tokens(_Tied), "torch.nn"),
    "nn_inplace": Entry("torch.nn: in-place activations", _tokens(_inplace), "torch.nn"),
    # torchtitan
    "torchtitan_llama": Entry("torchtitan: Llama 3 (fused QKV, state_dict hooks)", torchtitan_llama, "torchtitan"),
}
