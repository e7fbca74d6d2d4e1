"""A small user model whose own code fails when asked to: what oneiter must report as the user's error (exit 2).

`build(batch_size, mode="")` — `mode` (or the environment variable ONEITER_TEST_USER_ERROR, which wins when set):
- "" (default): a clean model, recorded as a reference;
- "forward_shape": the submodule `layers.1.mlp` feeds its second Linear the wrong width in its own forward
  (a shape mismatch raised by torch inside the user's frame);
- "backward_inplace": `layers.1.mlp` saves a tensor for backward (sigmoid's output) and then changes it in place;
  autograd raises "one of the variables needed for gradient computation has been modified by an inplace
  operation" during backward.
The error is raised only in the second block's call (`layers.1.mlp@0`), never in `layers.0.mlp`.
"""

import os

import torch
import torch.nn as nn

ENV = "ONEITER_TEST_USER_ERROR"


class MLP(nn.Module):
    def __init__(self, width: int, mode: str):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.mode = mode

    def forward(self, x):
        h = self.up(x)
        if self.mode == "forward_shape":
            return self.down(h[..., :-1])  # one column short: the Linear raises
        g = torch.sigmoid(h)  # sigmoid saves its output for backward
        if self.mode == "backward_inplace":
            g.mul_(2.0)  # ...which this changes in place: backward raises
        return self.down(g * h)


class Block(nn.Module):
    def __init__(self, width: int, mode: str):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = MLP(width, mode)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int, mode: str):
        super().__init__()
        self.layers = nn.ModuleList([Block(width, ""), Block(width, mode)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(batch_size, mode: str = ""):
    mode = os.environ.get(ENV, mode)
    if mode not in ("", "forward_shape", "backward_inplace"):
        raise ValueError(f"unknown mode {mode!r}")
    model = Net(8, mode)
    x = torch.randn(batch_size, 8)
    y = torch.randint(0, 3, (batch_size,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y.to(out.device))


def build_sequential(batch_size):
    """A stock nn.Sequential whose second Linear expects 15 features where the first gives 16: the user's bug,
    raised inside torch's own `Linear.forward` (no line of this file is in the traceback below the model call)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(15, 4))
    x = torch.randn(batch_size, 8)
    return model, (x,), lambda out: out.square().mean()


def build_bad_optimizer(batch_size, partial: bool = False):
    """A model whose `make_optimizer` raises TypeError inside torch's AdamW (betas must be a pair): from a line of
    this file, or (`partial`) from a `functools.partial` of the optimizer class, which has no line of its own."""
    import functools

    model, inputs, loss_fn = build(batch_size)
    if partial:
        return model, inputs, loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3, betas=0.9)
    return model, inputs, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3, betas=0.9)


def build_adamw(batch_size):
    """A clean model whose fourth item builds AdamW (whatever --optimizer says)."""
    model, inputs, loss_fn = build(batch_size)
    return model, inputs, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False)
