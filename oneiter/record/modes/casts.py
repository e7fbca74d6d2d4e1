"""Casts to a narrower float, written into a model's code, in a high-precision rerun: kept in the high precision.

Where this sits: the calibration measures a precision's noise as the same code run twice, in the run's precision and
in float64 (`record/local/probe.py`). A cast the model's own code makes (`x.to(torch.float8_e4m3fn)`, `x.half()`, a
segment computed in float16 by explicit casts) would run in the float64 rerun too: its rounding, and the precision of
everything computed after it, would be in both runs and invisible to the noise, while a target whose float16 kernel
merely rounds otherwise than the CPU's (another device's, correct) differs by exactly that: a false culprit. So inside
a high-precision rerun (`record/local/rerun.py` enters `KeptCasts` for float64 sites and the calibration's high run;
`record/replay/layer_replay.py` for its float64 run) a cast to a floating format narrower than float32 keeps its
input's dtype: the rounding is in the noise, not in the code. A scaled matrix product of such kept operands
(`torch._scaled_mm`, which takes float8 ones) is computed exactly (`scaled_mm_exact`).

In a run of the calibration's check (`inject`: the float64 runs with a precision's rounding injected into every op,
`roundoff_mode.py`) the casts run as written: what they produce (their rounding, and where values leave the format's
range, underflow to zero and saturation; in backward the gradient's own cast, which autograd makes to the narrow
format: a gradient cast to float8 without a scale), so a noise that holds their rounding is not taken for an
untrusted one. A scaled product stays exact there too (never a plugin's kernel: it may be the one under test).

Low-precision *recipes* (torchao's float8 Linears, MX) are not calibrated by reruns at all: they are judged against
their exact emulation (`record/local/recipes.py`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KeptCasts", "narrow", "scaled_mm_exact"]


def narrow(dtype) -> bool:
    """A floating format narrower than float32: float16, bfloat16, the float8 (and float4) ones."""
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize < 4


def scaled_mm_exact(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                    use_fast_accum=False):
    """`torch._scaled_mm`'s result computed exactly in float64: (mat1 * scale_a) @ (mat2 * scale_b) + bias, the scales
    per tensor or per row (of mat1) and column (of mat2); None where the op asks for what this does not compute (a
    result scale, block scales)."""
    sa, sb = scale_a.double(), scale_b.double()
    if scale_result is not None or sa.numel() not in (1, mat1.shape[0]) or sb.numel() not in (1, mat2.shape[1]):
        return None
    a = mat1.double() * (sa.reshape(()) if sa.numel() == 1 else sa.reshape(-1, 1))
    b = mat2.double() * (sb.reshape(()) if sb.numel() == 1 else sb.reshape(1, -1))
    out = a @ b
    return out + bias.double() if bias is not None else out


class KeptCasts(TorchDispatchMode):
    """The block is a high-precision rerun: casts to narrower floats keep their input's dtype, scaled products of
    such operands are exact (module docstring). `seed` given (a run of the calibration's check, `roundoff_mode.py`):
    the casts run as written; None: keep them exact."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # an eager-only mode

    def __init__(self, seed: int | None = None):
        super().__init__()
        self.check = seed is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            return NotImplemented  # a tensor subclass (torchao's float8 tensors) dispatches it, this mode still on
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_to_copy" and args and narrow(kwargs.get("dtype")) and _wide(args[0]):
            if self.check:  # the cast as written: its rounding and range, and in backward the gradient's

                return func(*args, **kwargs)
            return func(*args, **{**kwargs, "dtype": args[0].dtype})
        if name == "_scaled_mm" and len(args) >= 4 and (self.check or (_wide(args[0]) and _wide(args[1]))):
            exact = scaled_mm_exact(*args, **kwargs)  # never the kernel: a plugin's may be the one under test
            if exact is not None:
                wide = _wide(args[0]) and _wide(args[1])
                out_dtype = kwargs.get("out_dtype") or (args[6] if len(args) > 6 else None) or args[0].dtype
                return exact.to(torch.promote_types(args[0].dtype, args[1].dtype) if wide else out_dtype)
        return func(*args, **kwargs)


def _wide(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype.itemsize >= 4
