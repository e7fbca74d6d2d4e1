"""What `oneiter replay --ops` costs, against a plain `oneiter replay` of the same layer call.

    nice -n 10 python bench/bench_ops.py [--repeat 3] [--dir /tmp/oneiter-bench-ops] [--threads N]

Cases: one decoder layer of the built-in `llama_tiny` at the 118 M configuration's width (dim 1024, 16 heads,
hidden 2816; 2 layers, vocabulary 8192, sequence 128, batch 4), replayed in float32 and under bf16 autocast; and a
resnet18 BasicBlock (`layer1.0`: 64 channels at 56x56, batch 8, 224x224 images). Each reference records only that
layer (`include`), on the CPU in float32. Each case runs in its own fresh process (`import torch` excluded): one
untimed `replay_layer` first (thread pools, the model's build), then `--repeat` alternating pairs of the whole
`replay_layer` call (rebuild the model, run the layer once forward and backward, check it) and the whole
`replay_ops` call (rebuild, the traced run with every op rerun in float64 on the CPU and, where its error exceeds one
unit roundoff, once more in its own dtypes for its noise; then the float64 run of the layer's program). Printed per
case: median (and range) of the wall seconds of each and their ratio, the layer's own forward+backward seconds (the
plain replay's timing), the number of ops dispatched, judged and Monte-Carlo calibrated (only where the CPU has no
kernel in an op's dtypes), the highest ratio a clean op reached and the program check's highest ratio (a clean
layer stays below 4; on the CPU the traced kernels are the calibration's own, so a clean op's ratio is at most 1).
Timings on a shared machine vary with its load; each figure is the median of `--repeat`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CASES = {
    "llama_tiny layers.0 (dim 1024) float32": ("llama_tiny", "layers.0", None, 4,
                                              {"dim": 1024, "num_heads": 16, "num_layers": 2, "vocab_size": 8192,
                                               "seq_len": 128}),
    "llama_tiny layers.0 (dim 1024) bf16 autocast": ("llama_tiny", "layers.0", "bf16", 4,
                                                    {"dim": 1024, "num_heads": 16, "num_layers": 2,
                                                     "vocab_size": 8192, "seq_len": 128}),
    "resnet18 layer1.0 BasicBlock (b8, 224x224)": ("resnet18", "layer1.0", None, 8, {}),
}

CHILD = """
import json, statistics, sys, time
from pathlib import Path
import torch
from oneiter.judge.replayed.layer_verdict import replay_layer
from oneiter.judge.replayed.op_verdict import replay_ops
from oneiter.record.run import SpecOptions, record
model, layer, amp, batch, args, out, repeat, threads = json.loads(sys.argv[1])
if threads:
    torch.set_num_threads(threads)
ref = Path(out)
if not ref.exists():
    record(SpecOptions(out=ref, model=model, batch_size=batch, model_args=args, include=[f"^{layer}$"]))
kw = {"amp": amp} if amp else {}
first = replay_layer(ref, layer, **kw)
plain, ops, run = [], [], []
for _ in range(repeat):
    start = time.perf_counter(); r = replay_layer(ref, layer, **kw); plain.append(time.perf_counter() - start)
    run.append(r.forward_seconds[0] + (r.backward_seconds[0] if r.backward_seconds else 0.0))
    start = time.perf_counter(); result = replay_ops(ref, layer, **kw); ops.append(time.perf_counter() - start)
judged = result.judged
print(json.dumps({"plain": plain, "ops": ops, "run": run, "num_ops": len(result.rows), "num_judged": len(judged),
                  "num_mc": sum(r.noise_from == "monte_carlo" for r in judged),
                  "max_ratio": max((r.ratio or 0.0) for r in judged), "exit_code": result.exit_code,
                  "program_max": max((t.ratio for t in result.program), default=0.0)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oneiter-bench-ops"))
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{'case':46} {'replay s (range)':>17} {'--ops s (range)':>17} {'ratio':>6} {'layer run s':>11} {'ops':>5} "
          f"{'judged':>6} {'MC':>4} {'max clean ratio':>15} {'program':>7}")
    for name, (model, layer, amp, batch, model_args) in CASES.items():
        out = args.dir / f"{model}_{layer}.h5"
        job = json.dumps([model, layer, amp, batch, model_args, str(out), args.repeat, args.threads])
        done = subprocess.run([sys.executable, "-c", CHILD, job], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-2000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        plain, ops = statistics.median(r["plain"]), statistics.median(r["ops"])
        spans = [f"{m:5.2f} ({min(v):.2f}-{max(v):.2f})" for m, v in ((plain, r["plain"]), (ops, r["ops"]))]
        print(f"{name:46} {spans[0]:>17} {spans[1]:>17} {ops / plain:5.1f}x {statistics.median(r['run']):11.3f} "
              f"{r['num_ops']:5d} {r['num_judged']:6d} {r['num_mc']:4d} {r['max_ratio']:14.2f}x "
              f"{r['program_max']:6.2f}x" + ("" if r["exit_code"] == 0 else "  (flagged!)"))


if __name__ == "__main__":
    main()
