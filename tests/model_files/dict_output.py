"""A user model returning a dict, with a keyword-free two-input forward and its own optimizer (4th item)."""

import torch
import torch.nn as nn


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.cls = nn.Linear(16, 3)
        self.reg = nn.Linear(16, 1)

    def forward(self, x, scale):
        h = self.act(self.body(x * scale))
        return {"logits": self.cls(h), "value": self.reg(h)}


def build(batch_size):
    model = TwoHeads()
    x, scale = torch.randn(batch_size, 8), torch.rand(batch_size, 1) + 0.5
    labels, target = torch.randint(0, 3, (batch_size,)), torch.randn(batch_size, 1)

    def loss_fn(out):
        ce = nn.functional.cross_entropy(out["logits"], labels.to(out["logits"].device))
        return ce + nn.functional.mse_loss(out["value"], target.to(out["value"].device))

    return model, (x, scale), loss_fn, lambda params: torch.optim.Adam(params, lr=1e-3, foreach=False)
