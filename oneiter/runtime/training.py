"""One training iteration: forward, loss, backward, optimizer step — the unit everything else records or profiles.

Optimizers are built without foreach/fused kernels so two runs of the same iteration on the same device are
bitwise equal; nothing here knows about recording, which hooks in from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from oneiter.errors import OneIterError, user_code
from oneiter.runtime.modelspec import ModelBundle

__all__ = ["OPTIMIZERS", "build_optimizer", "TrainSetup", "prepare", "train_step", "set_threads", "use_step"]

OPTIMIZERS = ("sgd", "adamw")


def build_optimizer(name: str, params, bundle: ModelBundle | None = None):
    """`sgd` (lr 0.01, momentum 0.9, weight decay 1e-4) or `adamw` (lr 1e-3); single-tensor kernels."""
    import torch

    if bundle is not None and bundle.make_optimizer is not None:
        # the user's function (or a torch optimizer it names) raising is their error: exit 2, one line
        with user_code("the model's make_optimizer (building the optimizer)", calls_user=True):
            return bundle.make_optimizer(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False, fused=False)
    raise OneIterError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{name}'")


def set_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count (the reduction order on CPU depends on it)."""
    import torch

    if num_threads is not None:
        if num_threads < 1:
            raise OneIterError(f"--threads must be at least 1, got {num_threads}")
        torch.set_num_threads(num_threads)


@dataclass
class TrainSetup:
    """A bundle moved to its device with its optimizer: ready for `train_step`."""

    bundle: ModelBundle
    device: Any
    optimizer: Any
    inputs: tuple
    loss_fn: Callable | None = None  # this step's loss (the bundle's `batch(step)`); None: the bundle's own
    dtype: Any = None  # the storage dtype floating inputs are cast to (`--dtype`), None: as they come


def prepare(bundle: ModelBundle, device, optimizer: str = "sgd") -> TrainSetup:
    """Move the model and inputs to `device` and build the optimizer."""
    model = bundle.model.to(device)
    model.train()
    inputs = tuple(t.to(device) for t in bundle.inputs)
    opt = build_optimizer(optimizer, model.parameters(), bundle)
    return TrainSetup(bundle, device, opt, inputs)


def use_step(setup: TrainSetup, step: int) -> None:
    """Make `setup` run iteration `step`: the bundle's `batch(step)` (inputs on the device, floating ones in the
    run's dtype, and its loss), or the bundle's own batch without `batch`."""
    inputs, loss_fn = setup.bundle.step_batch(step)
    dtype = setup.dtype
    setup.inputs = tuple((t.to(dtype) if dtype is not None and t.is_floating_point() else t).to(setup.device)
                         for t in inputs)
    setup.loss_fn = loss_fn


def train_step(
    setup: TrainSetup,
    *,
    after_backward: Callable[[], None] | None = None,
    before_backward: Callable[[], None] | None = None,
    autocast: Any = None,
):
    """Run forward, loss, backward, optimizer step; return the (detached) loss.

    `before_backward` runs between loss and backward, `after_backward` between backward and the step (the
    recorder reads parameter gradients there);
    `autocast` is an optional context manager wrapped around forward and loss.
    """
    import contextlib

    model, opt = setup.bundle.model, setup.optimizer
    opt.zero_grad(set_to_none=True)
    with autocast if autocast is not None else contextlib.nullcontext():
        output = model(*setup.inputs)
        loss = (setup.loss_fn or setup.bundle.loss_fn)(output)
    if not hasattr(loss, "backward") or loss.numel() != 1:
        raise OneIterError(f"model '{setup.bundle.name}': loss_fn must return a scalar tensor")
    if before_backward is not None:
        before_backward()
    loss.backward()
    if after_backward is not None:
        after_backward()
    opt.step()
    return loss.detach()
