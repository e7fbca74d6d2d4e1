"""A small MLP trained with an optimizer a vendor stack supplies: torch's AdamW, or `VendorAdamW` in its own code.

`VendorAdamW` is AdamW (decoupled weight decay) written the way a vendor's fused kernel computes it: its own
order of operations (bias corrections folded into the step size, the decay applied after the update term), so its
updates differ from torch's by rounding only — a benign difference that must stay a MATCH. Its constructor takes
`eps_inside_sqrt`, an instance attribute (not a param-group option) that moves `eps` under the square root: a
classic fused-AdamW bug that changes the math of the update, nothing else.

`VendorAdamMV` is the same AdamW keeping its state under its own names: `m` and `v` for torch's `exp_avg` and
`exp_avg_sq`, and `step` (a vendor's fused Adam may name its moments so). `GroupStepAdamW` keeps its step count in
the param group (`group['step']`), one per group, as apex's FusedAdam does.

Choice (env ONEITER_TEST_FAULT, see faultkit): unset: torch.optim.AdamW; `optimizer:vendor`: VendorAdamW;
`optimizer:eps_inside_sqrt`: VendorAdamW(eps_inside_sqrt=True); `optimizer:mv`: VendorAdamMV. The weights, batch
and gradients are the same in all of them: only the optimizer's update differs.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from faultkit import apply_fault, fault_spec, patch_functions, undo_faults  # noqa: F401  (undo_faults: for tests)


class VendorAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2, eps_inside_sqrt=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.eps_inside_sqrt = eps_inside_sqrt

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                eps = group["eps"] * math.sqrt(1 - beta2 ** state["step"])
                denom = (v + eps * eps).sqrt() if self.eps_inside_sqrt else v.sqrt().add_(eps)
                update = m / denom
                p.add_(update, alpha=-step_size).add_(p, alpha=-group["lr"] * group["weight_decay"])
        return None


class VendorAdamMV(VendorAdamW):
    """VendorAdamW keeping its moments as `m` and `v`."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if p.grad is not None and not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                if state:  # VendorAdamW's step on torch's names, renamed back afterwards
                    state["exp_avg"], state["exp_avg_sq"] = state.pop("m"), state.pop("v")
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "exp_avg" in state:
                        state["m"], state["v"] = state.pop("exp_avg"), state.pop("exp_avg_sq")


class GroupStepAdamW(VendorAdamW):
    """VendorAdamW counting its steps in the param group, as apex's FusedAdam does."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                state = self.state[p]
                if p.grad is not None and not state:
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                if state:  # VendorAdamW's step from a per-parameter count one below the group's
                    state["step"] = group["step"] - 1
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].pop("step", None)


def _optimizer(params):
    spec = fault_spec()
    choice = spec[1] if spec is not None and spec[0] == "optimizer" else ""
    if choice == "":
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=1e-2)
    if choice not in ("vendor", "eps_inside_sqrt", "mv"):
        raise ValueError(f"unknown optimizer choice {choice!r}")
    if choice == "mv":
        return VendorAdamMV(params, lr=1e-3, eps=1e-6, weight_decay=1e-2)
    return VendorAdamW(params, lr=1e-3, eps=1e-6, weight_decay=1e-2, eps_inside_sqrt=choice == "eps_inside_sqrt")


def build(batch_size, features=16, hidden=32, num_classes=4):
    patch_functions()
    model = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, num_classes))
    x = torch.randn(batch_size, features)
    y = torch.randint(0, num_classes, (batch_size,))
    return apply_fault(model), (x,), lambda out: F.cross_entropy(out, y), _optimizer
