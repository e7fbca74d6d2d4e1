"""A stand-in vendor plugin whose float32 CPU kernel of one aten op is wrong, registered the way a plugin registers its
kernels: `torch.library` over the op, for one backend, at import time. It knows nothing of oneiter.

`import faulty_kernels` with the environment variable FAULTY_KERNEL set (`silu`: the forward kernel, `silu_backward`:
only the backward one) registers that kernel over torch's CPU kernel (FAULTY_KERNEL_KEY=CUDA: over its CUDA kernel,
a kernel wrong only on the GPU); the autograd formula is torch's own, as with a real plugin. The kernel computes the
right values with torch's `out=` kernel (its own registration, left alone) and, for float32 only, scales them by
1 + REL (FAULTY_KERNEL_REL, default 1e-3): other dtypes, float64 included, stay exact. Tests that run in-process call
`install(name)` and `uninstall()` instead of importing it with the variable set. The kernel is simply wrong, wherever
it runs: whatever oneiter reruns on the CPU meets it too.
"""

from __future__ import annotations

import os
import warnings

import torch

ENV, REL_ENV, KEY_ENV = "FAULTY_KERNEL", "FAULTY_KERNEL_REL", "FAULTY_KERNEL_KEY"
_LIB: list = []


def _scaled(out: torch.Tensor, rel: float) -> torch.Tensor:
    return out * (1.0 + rel) if out.dtype == torch.float32 else out


def install(name: str, rel: float | None = None, key: str | None = None) -> None:
    """Register the wrong kernel of `name` (`silu` or `silu_backward`) for `key` (the CPU unless FAULTY_KERNEL_KEY
    says otherwise; once: `uninstall` undoes it)."""
    uninstall()
    rel = float(os.environ.get(REL_ENV, "1e-3")) if rel is None else rel
    key = key or os.environ.get(KEY_ENV, "CPU")

    def silu(x):
        return _scaled(torch.ops.aten.silu.out(x, out=torch.empty_like(x)), rel)

    def silu_backward(grad, x):
        out = torch.empty_like(x)
        return _scaled(torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out), rel)

    kernels = {"silu": silu, "silu_backward": silu_backward}
    if name not in kernels:
        raise ValueError(f"{ENV} must be one of {', '.join(kernels)}, got {name!r}")
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is what a plugin does
        warnings.simplefilter("ignore")
        lib.impl(name, kernels[name], key)
    _LIB.append(lib)


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()


if os.environ.get(ENV):
    install(os.environ[ENV])
