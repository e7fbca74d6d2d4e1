"""A user model with dropout in the middle, to test random-op replay."""

import torch
import torch.nn as nn


def build(batch_size):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 64), nn.GELU(),
                          nn.Dropout(0.3), nn.Linear(64, 5))
    x = torch.randn(batch_size, 32)
    y = torch.randint(0, 5, (batch_size,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y.to(out.device))
