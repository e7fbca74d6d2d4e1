"""A stand-in for another device's float16 matrix kernel: correct, but rounded otherwise than torch's CPU kernel. It
knows nothing of oneiter.

`install()` registers a CPU kernel of `aten::addmm` (`uninstall()` removes it) that, for float16 operands, sums the
products in float64 and rounds the result to float16 once (torch's CPU kernel rounds otherwise): the result a more
precise float16 unit gives, within float16's rounding of the exact one, not bit for bit the CPU's. Other dtypes run
torch's own `addmm.out` kernel. A correct kernel: no fault, so a replay that runs it must match.
"""

from __future__ import annotations

import warnings

import torch

_LIB: list = []


def install(key: str = "CPU") -> None:
    uninstall()

    def addmm(bias, mat1, mat2, beta=1, alpha=1):
        if mat1.dtype != torch.float16:
            out = torch.empty((mat1.shape[0], mat2.shape[1]), dtype=mat1.dtype, device=mat1.device)
            return torch.ops.aten.addmm.out(bias, mat1, mat2, beta=beta, alpha=alpha, out=out)
        exact = beta * bias.double() + alpha * (mat1.double() @ mat2.double())
        return exact.to(torch.float16)

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is what a plugin does
        warnings.simplefilter("ignore")
        lib.impl("addmm", addmm, key)
    _LIB.append(lib)


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()
