"""Deliberate faults, to demo oneiter and to test that it names the right layer.

`--inject-fault PATH[:KIND][=REL][,rank=R]` on record, KIND one of:
- `forward` (default): the module's floating outputs are multiplied by (1 + REL) — a wrong kernel;
- `backward`: the forward is untouched, the gradient flowing into the module is multiplied by (1 + REL) — a
  wrong backward kernel (the module's recorded grad_output is right, its grad_input is not);
- `inf`: the first element of the module's first floating output becomes +Inf.
REL defaults to 0.05 (5 %). `,rank=R` (multi-rank runs under torchrun) injects the fault on rank R only; without
it every rank gets it. (`@` is not used here: everywhere in oneiter `module@N` means call N of that module.)
Faults are stored in the recording's `faults` attribute (each rank's file lists its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oneiter.errors import OneIterError
from oneiter.record.modes import trusted
from oneiter.runtime.compiled import eager_name, find_blocks, outside_call

__all__ = ["Fault", "parse_fault", "attach_faults"]

KINDS = ("forward", "backward", "inf")


@dataclass(frozen=True)
class Fault:
    module: str
    kind: str = "forward"
    rel: float = 0.05
    rank: int | None = None  # None: every rank

    def __str__(self) -> str:
        return f"{self.module}:{self.kind}={self.rel:g}" + ("" if self.rank is None else f",rank={self.rank}")

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse_fault(text: str) -> Fault:
    """`layer3.0.conv1`, `layer3.0.conv1:backward`, `layer3.0.conv1:forward=0.1`, `layer3.0.conv1,rank=1`."""
    if "@" in text:
        path, _, call = text.partition("@")
        raise OneIterError(f"faults: '@' means a call index in oneiter, not a rank: write a fault's rank as "
                           f"',rank=R' (e.g. {path},rank={call or 1}), got '{text}'", param="faults")
    text_no_rank, comma, rank_part = text.partition(",")
    rank_text = rank_part.removeprefix("rank=")
    if comma and (not rank_part.startswith("rank=") or not rank_text.isdigit()):
        raise OneIterError(f"faults: the rank is written ',rank=R' with R a rank number such as 1, got '{text}'",
                           param="faults")
    spec, _, rel_text = text_no_rank.partition("=")
    module, _, kind = spec.partition(":")
    kind = kind or "forward"
    if not module or kind not in KINDS:
        raise OneIterError(f"faults expects PATH[:{'|'.join(KINDS)}][=REL][,rank=R], got '{text}'", param="faults")
    try:
        rel = float(rel_text) if rel_text else 0.05
    except ValueError:
        raise OneIterError(f"faults: REL must be a number, got '{rel_text}'", param="faults") from None
    return Fault(module, kind, rel, int(rank_text) if comma else None)


def attach_faults(model, faults: list[Fault]) -> list:
    """Register the faults as forward hooks; returns the handles (remove them to undo). A compiled block is faulted
    at its call, outside its compiled code; a module inside one cannot be (its code runs inside the graph)."""
    if not faults:
        return []
    blocks = find_blocks(model)
    modules = {eager_name(path): m for path, m in model.named_modules() if not blocks.hides(path)}
    handles = []
    for fault in faults:
        if fault.module not in modules:
            block = blocks.around(fault.module)
            if block is not None:
                raise OneIterError(f"--inject-fault: '{fault.module}' runs inside the compiled block "
                                   f"'{block.path or '(root)'}', where oneiter adds nothing; fault the block itself, "
                                   f"or a module outside compiled code")
            near = [n for n in modules if n.endswith(fault.module.rsplit(".", 1)[-1])][:3]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise OneIterError(f"--inject-fault: the model has no module '{fault.module}'{hint}")
        hook = _hook_for(fault)
        handles.extend(outside_call(modules[fault.module], post=lambda m, a, _k, out, hook=hook: hook(m, a, out)))
    return handles


def _hook_for(fault: Fault):
    def hook(_module, _args, output):
        if trusted.active():  # a fault stands for a wrong device kernel: trusted recomputations do not have it
            return None
        return _map_floating(output, lambda t: _apply(fault, t))

    return hook


def _apply(fault: Fault, tensor):
    import torch

    if fault.kind == "forward":
        return tensor * (1.0 + fault.rel)
    if fault.kind == "backward":
        return _ScaleGrad.apply(tensor, 1.0 + fault.rel)
    flat_index = torch.zeros(tensor.numel(), dtype=torch.bool, device=tensor.device)
    flat_index[0] = True
    return torch.where(flat_index.view(tensor.shape), torch.full_like(tensor, float("inf")), tensor)


def _map_floating(output, fn):
    import torch

    if isinstance(output, torch.Tensor):
        return fn(output) if output.is_floating_point() else output
    if isinstance(output, (tuple, list)):
        return type(output)(_map_floating(o, fn) for o in output)
    if isinstance(output, dict):
        return {k: _map_floating(v, fn) for k, v in output.items()}
    return output


def _scale_grad_class():
    import torch

    class ScaleGrad(torch.autograd.Function):
        """Identity forward; the gradient is multiplied by `scale`."""

        @staticmethod
        def forward(ctx, tensor, scale):
            ctx.scale = scale
            return tensor.clone()  # not a view: an in-place op may follow (ReLU(inplace=True))

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    return ScaleGrad


class _LazyScaleGrad:
    _cls: Any = None  # the autograd Function, made on first use (torch is imported lazily)

    def apply(self, tensor, scale):
        if _LazyScaleGrad._cls is None:
            _LazyScaleGrad._cls = _scale_grad_class()
        return _LazyScaleGrad._cls.apply(tensor, scale)


_ScaleGrad = _LazyScaleGrad()
