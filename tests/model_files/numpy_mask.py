"""A model that draws from the random generators outside torch in forward, as Hugging Face's Wav2Vec2 picks the
time steps SpecAugment masks in training with `numpy.random` (`_compute_mask_indices`): its `mask` module zeroes
time steps numpy chooses and a feature Python's `random` chooses. Nothing here knows oneiter."""

import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Mask(nn.Module):
    def forward(self, h):
        keep = torch.ones(h.shape[:2] + (1,), dtype=h.dtype)
        keep[:, np.random.choice(h.shape[1], size=2, replace=False)] = 0.0
        feature = torch.ones(h.shape[-1], dtype=h.dtype)
        feature[random.randrange(h.shape[-1])] = 0.0
        return h * keep * feature


class Net(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.mask = Mask()
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.mask(self.embed(x)))))


def build(batch_size):
    model = Net()
    x = torch.randn(batch_size, 6, 4)
    y = torch.randint(0, 3, (batch_size, 6))
    return model, (x,), lambda out: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1).to(out.device))
