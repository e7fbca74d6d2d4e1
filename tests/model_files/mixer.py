"""A tiny MLP-Mixer whose mixing blocks normalise functionally with parameters they own.

Token- and channel-mixing blocks call `F.layer_norm(x, shape, self.weight, self.bias)` and `F.gelu` in their own
forward (no nn.LayerNorm / nn.GELU submodules); the patch embedding is a strided conv; the root's forward
flattens the patches, applies its own final `F.layer_norm` and mean-pools the tokens. Kwargs: `image_size` (16),
`patch` (4), `dim` (32), `depth` (2), `num_classes` (10).

Fault targets (env ONEITER_TEST_FAULT, see faultkit), where they live:
- `root`                                        the root's own code (the token mean-pool line)
- `function:gelu`, `function:layer_norm`        `layers.0.token_mix`, own code (the first call)
- `function_bwd:gelu`                           `layers.1.channel_mix`, own code (backward meets the last call first)
- `function_bwd:layer_norm`                     the root's own code (its final layer_norm, met first in backward)
- `class:ChannelMixing` (`layers.0.channel_mix`), `class:TokenMixing`, `class:MixerLayer`
- `instance:layers.1.token_mix`, `instance:layers.0.channel_mix.fc2`, `instance:patch_embed`
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, fault_scale, patch_functions, undo_faults  # noqa: F401


class _Mixing(nn.Module):
    """LayerNorm (own parameters, functional) + MLP over the last dimension + residual."""

    def __init__(self, norm_dim, features, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(norm_dim) + 0.1 * torch.randn(norm_dim))
        self.bias = nn.Parameter(0.1 * torch.randn(norm_dim))
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, features)
        self.norm_dim = norm_dim


class TokenMixing(_Mixing):
    def forward(self, x):  # (B, T, C): the MLP mixes the T tokens
        y = F.layer_norm(x, (self.norm_dim,), self.weight, self.bias).transpose(1, 2)
        return x + self.fc2(F.gelu(self.fc1(y))).transpose(1, 2)


class ChannelMixing(_Mixing):
    def forward(self, x):  # (B, T, C): the MLP mixes the C channels
        y = F.layer_norm(x, (self.norm_dim,), self.weight, self.bias)
        return x + self.fc2(F.gelu(self.fc1(y)))


class MixerLayer(nn.Module):
    def __init__(self, tokens, dim):
        super().__init__()
        self.token_mix = TokenMixing(dim, tokens, 2 * tokens)
        self.channel_mix = ChannelMixing(dim, dim, 2 * dim)

    def forward(self, x):
        return self.channel_mix(self.token_mix(x))


class Mixer(nn.Module):
    def __init__(self, image_size=16, patch=4, dim=32, depth=2, num_classes=10):
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.layers = nn.ModuleList(MixerLayer(tokens, dim) for _ in range(depth))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.norm_bias = nn.Parameter(torch.zeros(dim))
        self.head = nn.Linear(dim, num_classes)
        self.dim = dim
        self.fault = fault_scale("root")  # `root`: 1 + REL, else exactly 1.0 (the multiply is skipped)

    def forward(self, images):
        x = torch.flatten(self.patch_embed(images), 2).transpose(1, 2)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        x = F.layer_norm(x, (self.dim,), self.norm_weight, self.norm_bias)
        x = x.mean(dim=1)
        if self.fault != 1.0:
            x = x * self.fault
        return self.head(x)


def build(batch_size, image_size=16, patch=4, dim=32, depth=2, num_classes=10):
    patch_functions()
    model = Mixer(image_size, patch, dim, depth, num_classes)
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch_size,))
    return apply_fault(model), (images,), lambda out: F.cross_entropy(out.float(), labels.to(out.device))
