"""The Monte Carlo noise estimate against the float64-based one, on ops that have float64.

    python bench/monte_carlo_noise.py [--dir /tmp/oneiter-mc] [--samples 4]

A float32 CPU reference of tests/model_files/float64_ops.py (conv, linear, layer norm, softmax, silu, each a leaf)
and of tests/model_files/hf_llama.py is replayed in several precisions, every row calibrated (even those within
one unit roundoff): once with the high-precision run (float64 on the CPU), once with it refused, so the noise is
the Monte Carlo estimate (oneiter/record/local/montecarlo.py, with SCALE 1). Prints, per precision, the ratio
Monte Carlo / float64 of every calibrated row's noise_target: min, median, max, and the worst rows. The ratio's
median is what `montecarlo.SCALE` divides out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
FILES = HERE.parent / "tests" / "model_files"
sys.path.insert(0, str(FILES))
sys.path.insert(0, str(HERE.parent))

MODELS = {"float64_ops": {"batch_size": 4}, "hf_llama": {"batch_size": 2}}
PRECISIONS = {"float32": {}, "bf16 autocast": {"amp": "bf16"}, "fp16 autocast": {"amp": "fp16"},
              "bfloat16 weights": {"dtype": "bfloat16"}}


def _noise(ref: Path, out: Path, spec: str, refuse_high: bool, **options) -> dict:
    from oneiter.judge.iteration.engine import compare_files
    from oneiter.record.local import montecarlo
    from oneiter.record.local.probe import LocalProbe
    from oneiter.record.local.rows import JudgedRow
    from oneiter.record.run import SpecOptions, record

    def refused(self, rec, site, where):
        return None, f"{where}:{montecarlo.MONTE_CARLO}"

    with mock.patch.object(JudgedRow, "needs_noise", lambda self, roundoff: True), \
            mock.patch.object(montecarlo, "SCALE", 1.0):
        if refuse_high:
            with mock.patch.object(LocalProbe, "_high", refused):
                record(SpecOptions(out=out, replay=ref, model=spec, force=True, **options))
        else:
            record(SpecOptions(out=out, replay=ref, model=spec, force=True, **options))
    result = compare_files(ref, out)
    return {r.key if hasattr(r, "key") else (r.module, r.call, r.phase, r.tensor): r.calibrated
            for r in result.local if r.calibrated is not None and r.phase in ("forward", "backward")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oneiter-mc"))
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    from oneiter.record.local import montecarlo
    from oneiter.record.run import SpecOptions, record

    if args.samples:
        montecarlo.SAMPLES = args.samples
    print(f"samples per estimate: {montecarlo.SAMPLES}")
    for name, kwargs in MODELS.items():
        spec = f"{FILES / name}.py:build"
        ref = args.dir / f"{name}-ref.h5"
        record(SpecOptions(out=ref, model=spec, seed=0, force=True, **kwargs))
        for label, options in PRECISIONS.items():
            f64 = _noise(ref, args.dir / f"{name}-f64.h5", spec, False, **options)
            mc = _noise(ref, args.dir / f"{name}-mc.h5", spec, True, **options)
            ratios = sorted((mc[k] / f64[k], k) for k in f64 if k in mc and f64[k] > 0 and math.isfinite(mc[k]))
            if not ratios:
                continue
            values = [r for r, _ in ratios]
            print(f"{name:12s} {label:17s} rows {len(values):3d}  MC/f64 min {values[0]:.2f}  "
                  f"median {statistics.median(values):.2f}  max {values[-1]:.2f}  "
                  f"geomean {math.exp(statistics.fmean(math.log(v) for v in values if v > 0)):.2f}")
            for ratio, key in ratios[:3] + ratios[-2:]:
                print(f"    {ratio:6.2f}  {key[0]}@{key[1]} {key[2]} {key[3]}  f64 {f64[key]:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
