"""A tiny LLaMA-style decoder in pure torch: RMSNorm, rotary position embeddings, causal attention, SwiGLU.

Sits behind the `llama_tiny` entry of the `oneiter.models` registry. Module names follow Meta's reference
implementation (`tok_embeddings`, `layers.N.attention.wq`, `layers.N.feed_forward.w1`, `norm`, `output`).
Everything is written with plain tensor ops so it runs under float32, bfloat16, float16 and `torch.autocast`:
rotary angles are computed in float32 with real cos/sin (no complex numbers) and cast to the activation dtype,
attention is an explicit matmul + causal mask + float32 softmax, and RMSNorm normalises in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oneiter.errors import ModelError

__all__ = ["RMSNorm", "Attention", "FeedForward", "TransformerBlock", "Transformer", "llama_tiny"]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel `weight` (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rotary_cos_sin(seq_len: int, head_dim: int, device: torch.device, theta: float = 10000.0):
    """`(cos, sin)` of the rotary angles, each `(seq_len, head_dim // 2)`, in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent channel pair `(x[2i], x[2i+1])` of `x` `(batch, seq, heads, head_dim)` by its angle.

    The real-valued form of Meta's complex `x * exp(i * angle)`; `cos`/`sin` are cast to `x.dtype`.
    """
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings on the queries and keys."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.num_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.num_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.num_heads, self.head_dim)

        cos, sin = rotary_cos_sin(seq_len, self.head_dim, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, head_dim)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(v)
        if self.attn_dropout is not None:
            probs = self.attn_dropout(probs)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(batch, seq_len, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1(x)) * w3(x))`."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(attention_norm(x))`, `out = h + feed_forward(ffn_norm(h))`."""

    def __init__(self, dim: int, num_heads: int, hidden_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, num_heads, dropout)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def default_hidden_dim(dim: int, multiple_of: int = 32) -> int:
    """LLaMA's SwiGLU width: `8/3 * dim` rounded up to a multiple of `multiple_of` (192 for dim 64)."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class Transformer(nn.Module):
    """Token embedding, `num_layers` blocks, final RMSNorm and the `output` projection to vocabulary logits."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, num_heads, hidden_dim, dropout) for _ in range(num_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

        # GPT-2 style: N(0, 0.02) everywhere, residual projections scaled down by sqrt(2 * num_layers).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama_tiny(
    batch_size: int,
    seq_len: int = 32,
    vocab_size: int = 256,
    dim: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    hidden_dim: int | None = None,
    dropout: float = 0.0,
):
    """Tiny LLaMA on random tokens: `(model, (tokens,), loss_fn)`, float32, train mode, on the CPU.

    Weights, then tokens `randint(vocab_size, (batch_size, seq_len))` (int64) are drawn from the global
    torch RNG. `loss_fn(logits)` is next-token cross entropy (`logits[:, :-1]` against `tokens[:, 1:]`)
    in float32. `hidden_dim=None` uses `default_hidden_dim(dim)`.
    """
    if num_heads < 1 or dim % num_heads or (dim // num_heads) % 2:
        raise ModelError(f"llama_tiny: dim ({dim}) must split into num_heads ({num_heads}) heads of even size")
    if seq_len < 2:
        raise ModelError(f"llama_tiny: seq_len must be at least 2 for next-token loss, got {seq_len}")
    if vocab_size < 1 or num_layers < 1:
        raise ModelError(f"llama_tiny: vocab_size and num_layers must be positive, got {vocab_size}, {num_layers}")
    if not 0.0 <= dropout < 1.0:
        raise ModelError(f"llama_tiny: dropout must be in [0, 1), got {dropout}")
    hidden_dim = default_hidden_dim(dim) if hidden_dim is None else hidden_dim

    model = Transformer(vocab_size, dim, num_layers, num_heads, hidden_dim, dropout).float().train()
    tokens = torch.randint(vocab_size, (batch_size, seq_len), dtype=torch.int64)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        targets = tokens.to(logits.device)[:, 1:].reshape(-1)
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets)

    return model, (tokens,), loss_fn
