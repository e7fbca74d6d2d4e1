"""MobileNetV2 in pure torch, with torchvision's module names, parameter shapes and initialisation.

Sits behind the `mobilenet_v2` entry of the `oneiter.models` registry. `MobileNetV2().state_dict()` has
exactly the keys and shapes of `torchvision.models.mobilenet_v2()` (`features.N...`, `classifier.1`); the
conv-norm-activation triples are plain `nn.Sequential`s like torchvision's `Conv2dNormActivation`.
"""

from __future__ import annotations

import torch
from torch import nn

from oneiter.models.resnet import classification_loss

__all__ = ["ConvBNReLU6", "InvertedResidual", "MobileNetV2", "mobilenet_v2"]

# t (expansion), c (output channels), n (repeats), s (stride of the first repeat)
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """Round `v` to a multiple of `divisor`, never going down by more than 10% (torchvision's helper)."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU6(nn.Sequential):
    """`Sequential(Conv2d, BatchNorm2d, ReLU6(inplace=True))`: torchvision's `Conv2dNormActivation` here."""

    def __init__(self, in_planes: int, out_planes: int, kernel_size: int = 3, stride: int = 1, groups: int = 1) -> None:
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_planes),
            nn.ReLU6(inplace=True),
        )
        self.out_channels = out_planes


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear); residual when the shape is unchanged."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride should be 1 or 2, got {stride}")
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup

        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(inp, hidden_dim, kernel_size=1))
        layers.extend(
            [
                ConvBNReLU6(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
                nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
                nn.BatchNorm2d(oup),
            ]
        )
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision's `MobileNetV2(num_classes, width_mult)` with `round_nearest=8` and dropout 0.2."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2) -> None:
        super().__init__()
        round_nearest = 8
        input_channel = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)

        features: list[nn.Module] = [ConvBNReLU6(3, input_channel, stride=2)]
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, output_channel, stride, expand_ratio=t))
                input_channel = output_channel
        features.append(ConvBNReLU6(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)

        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(self.last_channel, num_classes),
        )

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


def mobilenet_v2(batch_size: int, image_size: int = 224, num_classes: int = 1000, width_mult: float = 1.0):
    """MobileNetV2 on random images: `(model, (images,), loss_fn)`, float32, train mode, on the CPU.

    Weights, then images `randn(batch_size, 3, image_size, image_size)`, then labels
    `randint(num_classes, (batch_size,))` are drawn from the global torch RNG, in that order.
    The classifier's dropout (p=0.2) is active in train mode, as in torchvision.
    """
    model = MobileNetV2(num_classes=num_classes, width_mult=width_mult).float().train()
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(num_classes, (batch_size,))
    return model, (images,), classification_loss(labels)
