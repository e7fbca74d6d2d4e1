"""Reproducing a run's reduced-precision float32 matmuls and convolutions (TF32, HF32, bf16) in a CPU rerun.

Where this sits: a `Site` of `rerun.py` may name the families the run it stands for ran reduced
(`oneiter/runtime/precision_modes.py` reads them from torch's flags; the recording keeps them in its root
attribute `precision_modes`); `Rerunner` then runs the call under `ReducedOperands`, a TorchDispatchMode that
rounds the float32 *operands* of each governed aten op — the two factors of a matmul, the input and weight of a
convolution, and in backward the gradient and both factors of `convolution_backward` (backward matmuls are
plain mm/addmm and are caught as such) — to the mode's mantissa, then runs the op as it is. Bias and outputs are
not rounded: the hardware accumulates in float32, which the CPU kernel does too. The rounding is
`precision_modes.round_mantissa` (10 explicit bits for TF32 and HF32, 7 for bf16, to nearest even).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oneiter.runtime.precision_modes import FAMILY_OPS, MANTISSA_BITS, OPERANDS, round_mantissa

__all__ = ["ReducedOperands", "OPERANDS"]


class ReducedOperands(TorchDispatchMode):
    """Round the float32 operands of the governed ops: `families` maps family -> mode (`tf32`, `hf32`, `bf16`).
    `rounded` counts the ops it rounded (a call whose rerun rounded none ran no governed op)."""

    def __init__(self, families: dict[str, str]):
        super().__init__()
        self.bits = {op: MANTISSA_BITS[mode] for family, mode in families.items() for op in FAMILY_OPS[family]}
        self.rounded = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bits = self.bits.get(name)
        if bits is not None:
            args = list(args)
            for i in OPERANDS.get(name, ()):
                if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].dtype == torch.float32:
                    args[i] = round_mantissa(args[i], bits)
            self.rounded += 1
        return func(*args, **kwargs)
