"""oneiter record against msprobe's L0 tensor dump (the peer), same model code, batch and iteration, interleaved.

    python3 -m venv /tmp/msvenv && /tmp/msvenv/bin/pip install torch==2.13.0
    /tmp/msvenv/bin/pip install mindstudio-probe
    /tmp/msvenv/bin/python bench/msprobe_l0.py --oneiter .venv/bin/python [--repeat 4]
    /tmp/msvenv/bin/python bench/msprobe_l0.py --oneiter .venv/bin/python --level stats   # statistics, checksums

`--level stats` sets oneiter's `--level stats` against msprobe's `statistics` task at L0 with `summary_mode` `md5`
(its statistics plus a CRC32 of every tensor: the peer of oneiter's statistics and checksum; `--summary-mode
statistics` drops the CRC).

msprobe (PyPI `mindstudio-probe`) gets its own venv: it pins its own dependencies. Each run is a fresh process:
resnet18 (oneiter's own model file, loaded by path) at batch 8, 224x224, one warm-up forward/backward, then one
timed iteration (forward, loss, backward, SGD step) with msprobe's `PrecisionDebugger` (task `tensor`, level
`L0`, npy files) around it; or, with `--oneiter PYTHON`, the same iteration under `oneiter.Recorder` in that
interpreter. The two alternate; every run starts after `os.sync()` and deletes its output after it is measured,
so neither runs on memory the other left in the page cache (on a VM that alone moves a run by 30 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib.util, json, os, resource, shutil, sys, time
import torch
spec = importlib.util.spec_from_file_location("resnet_model", {resnet!r})
resnet_model = importlib.util.module_from_spec(spec); spec.loader.exec_module(resnet_model)
tool, work, level, summary_mode = {tool!r}, {work!r}, {level!r}, {summary_mode!r}
torch.manual_seed(0)
model, (x,), loss_fn = resnet_model.resnet18(8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn(model(x)).backward(); opt.zero_grad(set_to_none=True)   # warm, weights unchanged
out = os.path.join(work, tool)
shutil.rmtree(out, ignore_errors=True); os.makedirs(out)

def step(inputs):
    loss = loss_fn(model(*inputs)); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

if tool == "msprobe":
    from msprobe.pytorch import PrecisionDebugger
    config = os.path.join(work, "msprobe.json")
    with open(config, "w") as f:
        if level == "stats":
            task = {{"task": "statistics", "statistics": {{"scope": [], "list": [], "data_mode": ["all"],
                                                          "summary_mode": summary_mode}}}}
        else:
            task = {{"task": "tensor", "tensor": {{"scope": [], "list": [], "data_mode": ["all"],
                                                  "file_format": "npy"}}}}
        json.dump({{**task, "dump_path": out, "rank": [], "step": [], "level": "L0", "async_dump": False}}, f)
    debugger = PrecisionDebugger(config_path=config)
    os.sync()
    t0 = time.perf_counter()
    debugger.start(model=model); step((x,)); debugger.stop(); debugger.step()
elif tool == "plain":
    os.sync()
    t0 = time.perf_counter()
    step((x,))
else:
    import oneiter
    os.sync()
    t0 = time.perf_counter()
    with oneiter.Recorder(model, os.path.join(out, "ref.h5"), optimizer=opt, level=level) as rec:
        step((rec.inputs(x),))  # one argument in, that argument back
seconds = time.perf_counter() - t0
files = [os.path.join(d, f) for d, _, names in os.walk(out) for f in names]
print(json.dumps({{"tool": tool, "seconds": seconds, "bytes": sum(map(os.path.getsize, files)), "files": len(files),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
shutil.rmtree(out, ignore_errors=True)
"""


def run(python: str, tool: str, work: Path, level: str, summary_mode: str) -> dict:
    code = CHILD.format(resnet=str(ROOT / "oneiter" / "models" / "resnet.py"), tool=tool, work=str(work), level=level,
                        summary_mode=summary_mode)
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if tool == "oneiter" else os.environ
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{tool} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--oneiter", help="python of a venv with oneiter installed: interleave oneiter record runs")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oneiter-vs-msprobe"))
    parser.add_argument("--level", choices=("full", "stats"), default="full",
                        help="stats: oneiter --level stats against msprobe's statistics task")
    parser.add_argument("--summary-mode", choices=("md5", "statistics"), default="md5",
                        help="msprobe's summary_mode with --level stats (md5: statistics and a CRC32 per tensor)")
    parser.add_argument("--plain", action="store_true", help="also time the iteration without either tool")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for tool, python in (("msprobe", sys.executable), ("oneiter", args.oneiter),
                             ("plain", sys.executable if args.plain else None)):
            if python:
                results.setdefault(tool, []).append(run(python, tool, args.dir, args.level, args.summary_mode))
    for tool, runs in results.items():
        secs = [r["seconds"] for r in runs]
        print(f"{tool:8} median {statistics.median(secs):.3f} s  runs {' / '.join(f'{s:.2f}' for s in secs)}  "
              f"{runs[0]['bytes'] / 1e6:,.1f} MB in {runs[0]['files']} files  "
              f"peak RSS {max(r['rss_mb'] for r in runs):,.0f} MB")
    if "msprobe" in results and "oneiter" in results:
        ratio = statistics.median(r["seconds"] for r in results["msprobe"]) / statistics.median(
            r["seconds"] for r in results["oneiter"])
        what = "L0 tensor dump (target: >= 2x, fewer bytes)" if args.level == "full" else \
            f"L0 statistics task, summary_mode {args.summary_mode}"
        print(f"oneiter record{' --level stats' if args.level == 'stats' else ''} is {ratio:.2f}x as fast as msprobe's "
              f"{what}")
    if "plain" in results:
        plain = statistics.median(r["seconds"] for r in results["plain"])
        print("x plain iteration: " + ", ".join(
            f"{tool} {statistics.median(r['seconds'] for r in runs) / plain:.2f}x" for tool, runs in results.items()
            if tool != "plain"))


if __name__ == "__main__":
    main()
