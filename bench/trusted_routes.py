"""How close each route of a trusted recomputation (oneiter/record/modes/trusted.py) comes to torch's own kernel.

    python bench/trusted_routes.py

For each stand-in plugin kernel registered over torch's CPU kernel (tests/model_files/faulty_kernels.py, tf32kit.py,
and kernels registered here), prints the plugin's rel_l2 to torch's result, the route a trusted recomputation takes,
whether its result is torch's bit for bit (else its rel_l2, in unit roundoffs), and what the kernel census cost
after the registration changed. Figures for docs/blame.md "Kernels the calibration runs".
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "model_files"))

import faulty_kernels  # noqa: E402 - the stand-ins live with the tests
import tf32kit  # noqa: E402

from oneiter.record.modes import trusted  # noqa: E402
from oneiter.runtime import kernels  # noqa: E402

U = 2.0**-24


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 3, 16, 16, generator=g), torch.randn(8, 3, 3, 3, generator=g)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 128, generator=g)
    grad = torch.randn(64, 3, 16, 16, generator=g)
    cases = {
        "silu": (lambda: torch.nn.functional.silu(x), lambda: faulty_kernels.install("silu")),
        "silu_backward": (lambda: torch.ops.aten.silu_backward(grad, x),
                          lambda: faulty_kernels.install("silu_backward")),
        "mm": (lambda: a @ b, tf32kit.install),
        "convolution": (lambda: torch.nn.functional.conv2d(x, w), tf32kit.install),
    }
    started = time.perf_counter()
    kernels.foreign("cpu")
    print(f"census, first in this process: {time.perf_counter() - started:.3f} s")
    for name, (compute, install) in cases.items():
        faulty_kernels.uninstall()
        tf32kit.uninstall()
        torchs = compute()
        install()
        started = time.perf_counter()
        kernels.foreign("cpu")
        census = time.perf_counter() - started
        plugin = compute()
        with trusted.running():
            routed = compute()
        label = {e.op: r.label for e, r in trusted.routes()}.get(f"aten::{name}")
        print(f"aten::{name}: the plugin's rel_l2 to torch's {rel(plugin, torchs):.2e}; routed through {label}: "
              f"bit for bit {torch.equal(routed, torchs)} (rel_l2 {rel(routed, torchs):.1e}); census {census:.3f} s")
    faulty_kernels.uninstall()
    tf32kit.uninstall()
    torchs = torch.nn.functional.silu(x)
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("silu", lambda t: t * 0, "CPU")
        lib.impl("silu.out", lambda t, *, out: out.copy_(t * 0), "CPU")
    with trusted.running():
        routed = torch.nn.functional.silu(x)
    kinds = [(e.op, r.kind) for e, r in trusted.routes() if e.op.startswith("aten::silu")]
    print(f"aten::silu and aten::silu.out both replaced: routes {kinds}; rel_l2 to torch's {rel(routed, torchs):.2e} "
          f"({rel(routed, torchs) / U:.2f} u)")
    lib._destroy()

    @torch.library.custom_op("bench_routes::scaled_tanh", mutates_args=())
    def scaled_tanh(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t) * (1.001 if t.dtype == torch.float32 else 1.0)

    scaled_tanh.register_fake(lambda t: torch.empty_like(t))
    exact = torch.tanh(x.double())
    with trusted.running():
        routed = torch.ops.bench_routes.scaled_tanh(x)
    own, mine = rel(torch.ops.bench_routes.scaled_tanh(x), exact), rel(routed, exact)
    print(f"a custom op wrong by 1e-3 in float32 only: its kernel {own:.2e} from exact; the float64 route "
          f"{mine:.2e} ({mine / U:.2f} u); torch's own float32 tanh {rel(torch.tanh(x), exact):.2e}")


if __name__ == "__main__":
    main()
