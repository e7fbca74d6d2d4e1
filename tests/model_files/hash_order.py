"""A model whose calls run in an order Python's per-process string hashing decides, as Hugging Face's ModernBERT
does: it computes one rotary table per attention kind, iterating `set(layer_types)`, by calling its `rope` module
with the kind's name. Two processes with other hash seeds call `rope` for the two kinds in the other order, so
`rope@0` is the `full` table in one and the `local` table in the other. Nothing here knows oneiter."""

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("full_attention", "sliding_attention")


class Rope(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        for kind, base in zip(KINDS, (160000.0, 10000.0), strict=True):
            self.register_buffer(f"{kind}_inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim),
                                 persistent=False)

    def forward(self, x, kind: str):
        t = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * getattr(self, f"{kind}_inv_freq")
        return torch.cat((t, t), dim=-1).cos().to(x.dtype)


class Net(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.rope = Rope(dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in KINDS])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.embed(x)
        tables = {kind: self.rope(h, kind) for kind in set(KINDS)}  # the order: this process's string hashing
        for layer, kind in zip(self.layers, KINDS, strict=True):
            h = h + layer(h * tables[kind])
        return self.head(h)


def build(batch_size):
    model = Net()
    x = torch.randn(batch_size, 5, 4)
    y = torch.randint(0, 3, (batch_size, 5))
    return model, (x,), lambda out: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1).to(out.device))
