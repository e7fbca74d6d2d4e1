"""CPU kernels that compute float32 convolutions and matmuls the way TF32 hardware does (cuDNN, cuBLAS).

They stand for a CUDA target with TF32 on, on a machine without a GPU. `install()` (the builder of `tf32_cnn.py`
calls it when the environment variable ONEITER_TEST_TF32 is set) overrides the CPU kernels of aten `convolution`,
`convolution_backward`, `mm` and `addmm` (`torch.library`): each rounds its float32 operands to TF32 (10 explicit
mantissa bits, to nearest even) and runs the real computation (the composite convolution kernels; mm and addmm
through bmm and baddbmm, whose kernels stay torch's). They know nothing of oneiter: whatever runs these ops on the CPU
meets them, oneiter's calibration reruns included (which must find them and run torch's own). `uninstall()` puts
torch's kernels back (tests record many models in one process). A module of its own, imported by name (a model
file is executed anew at each load: this one's state must outlive that).
"""

from __future__ import annotations

import warnings

import torch

ENV = "ONEITER_TEST_TF32"
_LIB: list = []


def tf32(t):
    """`t` with its float32 values rounded to TF32 (10 explicit mantissa bits, to nearest, ties to even)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        return t
    bits = t.view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return torch.where((bits & 0x7F800000) == 0x7F800000, bits, rounded).view(torch.float32)


def _operands(args: tuple, positions: tuple) -> list:
    args = list(args)
    for i in positions:
        args[i] = tf32(args[i])
    return args


def install() -> None:
    """Override the CPU kernels (once; `uninstall` undoes it)."""
    if _LIB:
        return
    composite = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    conv, conv_bwd = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default

    def convolution(*args):
        return conv.redispatch(composite, *_operands(args, (0, 1)))

    def convolution_backward(*args):
        return conv_bwd.redispatch(composite, *_operands(args, (0, 1, 2)))

    def mm(a, b):
        a, b = _operands((a, b), (0, 1))
        return torch.ops.aten.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0)

    def addmm(bias, a, b, *, beta=1, alpha=1):
        _, a, b = _operands((bias, a, b), (1, 2))
        out = torch.ops.aten.baddbmm(bias.expand(a.shape[0], b.shape[1]).unsqueeze(0), a.unsqueeze(0),
                                     b.unsqueeze(0), beta=beta, alpha=alpha)
        return out.squeeze(0)

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for name, fn in (("convolution", convolution), ("convolution_backward", convolution_backward),
                         ("mm", mm), ("addmm", addmm)):
            lib.impl(name, fn, "CPU")
    _LIB.append(lib)


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()
