"""A small MLP trained with a learning rate far too large: its training is chaotic (two runs one rounding apart
part within a few steps), the case a multi-step comparison cannot judge step by step."""

import torch


def build(batch_size, lr=2.0, width=64):
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 16))

    def batch(step):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(batch_size, 16, generator=gen)
        y = torch.randn(batch_size, 16, generator=gen)
        return (x,), lambda out: torch.nn.functional.mse_loss(out, y.to(out.device))

    inputs, loss_fn = batch(0)
    return model, inputs, loss_fn, lambda params: torch.optim.SGD(params, lr=lr, foreach=False), batch
