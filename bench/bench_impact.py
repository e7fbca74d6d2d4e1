"""What `record --impact` costs: a replay with `--impact --impact-top 5` against the same replay without it.

    python bench/bench_impact.py [--repeat 2] [--small] [--threads N] [--dir /tmp/oneiter-bench-impact]

For resnet18 (batch 8, 224x224; `--small`: 32x32, batch 2) and the built-in llama_tiny (batch 8; `--small`:
sequence 16, batch 2), in this process (`import torch` and the first replay's imports excluded: one warm-up replay
first): record a float32 reference, then replay it with five layers broken by `--inject-fault` (a wrong device
kernel: 1 % to 5 % on their outputs, which the trusted path does not have; resnet18's BatchNorms before a residual
add and its classifier, llama_tiny's projections) `--repeat` times without and with
`--impact --impact-top 5`, interleaved, and print the median seconds of the whole `record()` call of each, the
impact runs (nothing fixed, each of the 5 fixed, all fixed: 7) and their own seconds, and the shares the five fixes
got by the ranking's measure (a check that the runs measured what they should: every fault is fixed, so all five
together close the gap), and how far one rounding of the weights moves it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

FAULTS = {
    # each BatchNorm right before a residual add, and the classifier: a fault on a convolution's output is undone by the
    # BatchNorm after it (it normalises a scale away, forward and backward), these are not
    "resnet18": ["layer1.0.bn2", "layer2.1.bn2", "layer3.0.bn2", "layer4.0.bn2", "fc"],
    "llama_tiny": ["layers.0.attention.wq", "layers.0.feed_forward.w1", "layers.1.attention.wo",
                   "layers.1.feed_forward.w2", "layers.1.feed_forward.w3"],
}
RELS = [0.05, 0.04, 0.03, 0.02, 0.01]
SIZES = {"resnet18": ({}, 8), "llama_tiny": ({}, 8)}
SMALL = {"resnet18": ({"image_size": 32, "num_classes": 10}, 2), "llama_tiny": ({"seq_len": 16}, 2)}


def _record(**kwargs):
    from oneiter.record.run import SpecOptions, record

    began = time.perf_counter()
    summary = record(SpecOptions(force=True, **kwargs))
    return time.perf_counter() - began, summary


def bench(model: str, folder: Path, repeat: int, small: bool, threads: int | None) -> dict:
    args, batch = (SMALL if small else SIZES)[model]
    ref = folder / f"{model}.ref.h5"
    _record(out=ref, model=model, model_args=args, batch_size=batch, threads=threads)
    faults = [f"{layer}:forward={rel}" for layer, rel in zip(FAULTS[model], RELS, strict=True)]
    common = {"replay": ref, "faults": faults, "threads": threads}
    _record(out=folder / f"{model}.warm.h5", **common)  # the first replay's lazy imports
    plain, impact, summary = [], [], None
    for _ in range(repeat):
        plain.append(_record(out=folder / f"{model}.plain.h5", **common)[0])
        seconds, summary = _record(out=folder / f"{model}.impact.h5", impact=True, impact_top=5, **common)
        impact.append(seconds)
    from oneiter.judge.iteration.engine import compare_files

    ranking = compare_files(ref, folder / f"{model}.impact.h5").verdict_obj.impact
    key = "share" if ranking.by_loss else "grad_share"  # the gradients' when the loss is bit for bit
    return {"model": model, "plain": statistics.median(plain), "impact": statistics.median(impact),
            "runs": summary.impact_runs, "impact_seconds": summary.impact_seconds,
            "shares": [(f.name, getattr(f, key)) for f in ranking.fixes], "leaves": ranking.leaves,
            "by": "loss" if ranking.by_loss else "gradients", "sensitivity": ranking.sensitivity}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="the test suite's small shapes")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--models", nargs="*", default=list(FAULTS))
    opts = parser.parse_args()
    folder = opts.dir or Path(tempfile.mkdtemp(prefix="oneiter-bench-impact-"))
    folder.mkdir(parents=True, exist_ok=True)
    print("| model | replay | replay --impact --impact-top 5 | impact runs | their seconds | per run | shares |")
    print("|---|---|---|---|---|---|---|")
    for model in opts.models:
        r = bench(model, folder, opts.repeat, opts.small, opts.threads)
        shares = ", ".join(f"{name} {100 * share:.0f} %" for name, share in r["shares"])
        print(f"| {model} | {r['plain']:.2f} s | {r['impact']:.2f} s ({r['impact'] / r['plain']:.2f}x) | "
              f"{r['runs']} | {r['impact_seconds']:.2f} s | {r['impact_seconds'] / max(r['runs'], 1):.2f} s | "
              f"{r['by']}: {shares}; all fixed leave {100 * r['leaves']:.0f} %, one rounding moves "
              f"{100 * r['sensitivity']:.1f} % |", flush=True)


if __name__ == "__main__":
    main()
