"""What the type check adds to `.ci/run`: `python -m mypy oneiter` from a cold cache (a clean clone's case) and warm.

    python bench/bench_mypy.py              # 3 cold runs (each in a fresh cache folder), then 3 warm ones

Prints the median and range of the wall time of each, and the CPU time the checker's process used (user + sys of
the child), so a figure measured beside other work can be read against the CPU it really took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cache: str) -> tuple[float, float]:
    before = os.times()
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", cache, "oneiter"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def _show(name: str, runs: list[tuple[float, float]]) -> None:
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    print(f"{name}: wall {statistics.median(walls):.1f} s ({min(walls):.1f}-{max(walls):.1f}), "
          f"cpu {statistics.median(cpus):.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cold = [_run(os.path.join(folder, f"cold{i}")) for i in range(args.repeat)]
        warm = [_run(os.path.join(folder, "cold0")) for _ in range(args.repeat)]
    _show("cold cache", cold)
    _show("warm cache", warm)


if __name__ == "__main__":
    main()
