"""A small CNN for the TF32 tests: conv1 (3->8) -> relu -> conv2 (8->8) -> relu -> global average pool -> fc (8->10).

With the environment variable ONEITER_TEST_TF32 set (not `0`), the builder installs `tf32kit`'s CPU kernels:
float32 convolutions and matmuls with TF32 operands, as a CUDA GPU with TF32 on runs them.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from tf32kit import ENV, install


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def build(batch_size, image_size=8, num_classes=10):
    if os.environ.get(ENV, "").strip() not in ("", "0"):
        install()
    model = Net(num_classes)
    x = torch.randn(batch_size, 3, image_size, image_size)
    y = torch.randint(0, num_classes, (batch_size,))
    return model, (x,), lambda out: F.cross_entropy(out, y.to(out.device))
