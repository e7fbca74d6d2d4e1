"""A stand-in vendor plugin whose CPU kernel of `aten::_scaled_mm` applies one scale 1 % off, registered the way a
plugin registers its kernels: `torch.library` over the op, for one backend. It knows nothing of oneiter.

`install(rel=0.01)` registers it over torch's CPU kernel (`uninstall()` removes it); importing the module with the
environment variable FAULTY_SCALED_MM set (to REL, or 1 for 1 %) installs it, as a plugin's import does. The kernel
computes with torch's `_scaled_mm.out` kernel (its own registration, left alone) with `scale_a` multiplied by 1 + REL:
every float8 matrix product of torchao's Linears then comes out REL off, whatever its recipe (a rowwise product's
`scale_a` is the one torchao hands the kernel, ones; its result is REL off all the same).
"""

from __future__ import annotations

import os
import warnings

import torch

ENV = "FAULTY_SCALED_MM"
_LIB: list = []


def install(rel: float = 0.01, key: str = "CPU") -> None:
    uninstall()

    def scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        out = torch.empty((mat1.shape[0], mat2.shape[1]), dtype=out_dtype or mat1.dtype, device=mat1.device)
        return torch.ops.aten._scaled_mm.out(mat1, mat2, scale_a * (1.0 + rel), scale_b, bias, scale_result,
                                             out_dtype, use_fast_accum, out=out)

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is what a plugin does
        warnings.simplefilter("ignore")
        lib.impl("_scaled_mm", scaled_mm, key)
    _LIB.append(lib)


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()


if os.environ.get(ENV):
    install(0.01 if os.environ[ENV] == "1" else float(os.environ[ENV]))
