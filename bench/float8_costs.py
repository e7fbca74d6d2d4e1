"""FP8 on the tiny Hugging Face Llama: what the format costs per layer, how noisy the emulation is, which errors are
named, and what judging against the recipe costs.

    python bench/float8_costs.py [--dir /tmp/oneiter-float8] [--sizes 1e-2,1e-3,1e-4] [--batch-size 2]

Needs torchao (`pip install -c constraints.txt -e '.[float8]'`). The model is `tests/model_files/float8_models.py:
build_llama` (hidden 32, 2 layers, 14 Linears converted, lm_head in high precision). A float32 CPU reference is
recorded once; for each recipe (`tensorwise`, `rowwise`):

1. a clean replay with the model's Linears in torchao's float8 (`record --float8 RECIPE`), compared: per converted
   Linear the format's cost (the recipe's exact emulation against the reference, rel_l2) at its output, its input
   gradient and its weight gradient; the noise of the emulation (the accumulation's expected error) and the clean
   target's deviation from the recipe against it (its ratio); the verdict (it must be a MATCH);
2. replays with an error of each size in one converted Linear's forward (faultkit's `instance:` wrapper around
   `model.layers.1.mlp.down_proj`, in the model file): named (the culprit is that call's forward), missed or wrong;
3. seconds: the clean float8 replay against a plain float32 replay of the same reference (both with the per-call
   reruns), the same machine and process, median of `--repeat` runs: what judging against the recipe costs.

On a shared machine the seconds vary by +-30 %; the figures are exact otherwise (a CPU run is deterministic).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "model_files"))
LLAMA = str(ROOT / "tests" / "model_files" / "float8_models.py:build_llama")
LAYER = "model.layers.1.mlp.down_proj"
FAULT_ENV = "ONEITER_TEST_FAULT"


def record(out: Path, **kwargs):
    from oneiter.record.run import SpecOptions
    from oneiter.record.run import record as run

    return run(SpecOptions(out=out, model=LLAMA, force=True, **kwargs))


def timed(out: Path, **kwargs) -> float:
    started = time.perf_counter()
    record(out, **kwargs)
    return time.perf_counter() - started


def costs(ref: Path, tgt: Path) -> None:
    import oneiter

    v = oneiter.compare(str(ref), str(tgt)).verdict_obj
    print(f"  verdict: {v.headline[:160]}")
    heads = " ".join(f"{h:>9s}" for h in ("cost out", "grad_in", "grad_w", "noise", "deviation"))
    print(f"  {'call':36s} {heads} {'ratio':>6s}")
    for c in v.formats["calls"]:
        cells = [f"{c[k]:9.2e}" if c[k] is not None else f"{'-':>9s}" for k in (
            "cost_output", "cost_grad_input", "cost_weight", "noise", "deviation")]
        print(f"  {c['module'] + '@' + str(c['call']):36s} {' '.join(cells)} {c['ratio']:5.2f}x")
    outs = [c["cost_output"] for c in v.formats["calls"]]
    print(f"  format cost at the outputs: median {statistics.median(outs):.2e}, min {min(outs):.2e}, "
          f"max {max(outs):.2e}; worst ratio of a clean call {v.formats['worst']['ratio']:.2f}x")


def faults(ref: Path, folder: Path, recipe: str, sizes: list[float]) -> None:
    import oneiter

    for size in sizes:
        os.environ[FAULT_ENV] = f"instance:{LAYER}:{size}"
        try:
            record(folder / f"fault_{recipe}_{size}.h5", replay=ref, model_args={"float8": recipe})
        finally:
            os.environ.pop(FAULT_ENV, None)
            sys.modules["faultkit"].undo_faults()
        v = oneiter.compare(str(ref), str(folder / f"fault_{recipe}_{size}.h5")).verdict_obj
        c = v.culprit
        named = c is not None and (c.module, c.phase) == (LAYER, "forward")
        what = "named" if named else ("missed" if c is None else f"wrong ({c.module} {c.phase})")
        ratio = f", deviation {c.local_rel_l2:.2e} = {c.ratio:.0f}x its noise" if c is not None else ""
        print(f"  error {size:g} in {LAYER}'s forward: {what}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oneiter-float8"))
    parser.add_argument("--sizes", default="1e-2,1e-3,1e-4")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    args.dir.mkdir(parents=True, exist_ok=True)
    ref = args.dir / "ref.h5"
    record(ref, batch_size=args.batch_size)
    sizes = [float(s) for s in args.sizes.split(",")]
    for recipe in ("tensorwise", "rowwise"):
        print(f"torchao.float8 {recipe}")
        tgt = args.dir / f"clean_{recipe}.h5"
        record(tgt, replay=ref, float8=recipe)
        costs(ref, tgt)
        faults(ref, args.dir, recipe, sizes)
    plain = [timed(args.dir / "plain.h5", replay=ref) for _ in range(args.repeat)]
    fp8 = [timed(args.dir / "fp8.h5", replay=ref, float8="tensorwise") for _ in range(args.repeat)]
    print(f"seconds of an isolated replay (median of {args.repeat}): float32 {statistics.median(plain):.2f} "
          f"(range {min(plain):.2f}-{max(plain):.2f}), float8 tensorwise {statistics.median(fp8):.2f} "
          f"(range {min(fp8):.2f}-{max(fp8):.2f})")


if __name__ == "__main__":
    main()
