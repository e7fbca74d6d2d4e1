"""Trace size and profiling overhead of `oneiter profile` on ResNet-18, batch 8, 224x224 (the README numbers).

Runs the README command through the library `--repeats` times (each in a fresh output directory) and prints,
per run, the gzip trace size in bytes, the JSON size it expands to, the export time and the overhead: the
ratio of the median recorded step to the median of at least 5 unprofiled steps with both spreads, or "machine
too noisy to tell"; then every run's ratio side by side, to show whether it is stable. The same numbers come from:

    oneiter profile --model resnet18 --device cpu --batch-size 8 --schedule wait=1,warmup=1,active=2 -o prof/

Usage: python bench/bench_profile.py [--repeats 3] [--device cpu] [--batch-size 8] [--threads N] [--full]
(`--full` adds --record-shapes --profile-memory --with-stack --with-flops).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("ONEITER_NO_PROGRESS", "1")

SCHEDULE = "wait=1,warmup=1,active=2"


def run_once(out: Path, args) -> dict:
    from oneiter.profile.runner import ProfileOptions, profile

    full = dict(record_shapes=True, profile_memory=True, with_stack=True, with_flops=True) if args.full else {}
    start = time.perf_counter()
    result = profile(ProfileOptions(model="resnet18", device=args.device, batch_size=args.batch_size,
                                    threads=args.threads, schedule=SCHEDULE, out_dir=out, **full))  # fmt: skip
    cycle, overhead = result.cycles[0], result.overhead
    return {
        "trace": cycle["trace"], "trace_bytes": cycle["trace_bytes"], "json_bytes": cycle["trace_json_bytes"],
        "export_s": cycle["export_seconds"], "ratio": overhead["ratio"], "verdict": overhead["verdict"],
        "wall_s": time.perf_counter() - start, "threads": result.summary["threads"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--full", action="store_true", help="all opt-ins: shapes, memory, stack, flops")
    args = parser.parse_args()
    extra = " --record-shapes --profile-memory --with-stack --with-flops" if args.full else ""
    extra += f" --threads {args.threads}" if args.threads else ""
    print(f"command: oneiter profile --model resnet18 --device {args.device} --batch-size {args.batch_size} "
          f"--schedule {SCHEDULE}{extra} -o prof/")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            row = run_once(Path(tmp) / f"run{i}", args)
            rows.append(row)
            print(
                f"run {i}: trace {row['trace_bytes']} bytes gzip ({row['json_bytes']} bytes JSON, export "
                f"{row['export_s']:.3f} s); overhead {row['verdict']}; run took {row['wall_s']:.1f} s "
                f"({row['threads']} threads)"
            )
    print(f"trace name: {rows[0]['trace']}")
    print(f"median: trace {int(statistics.median(r['trace_bytes'] for r in rows))} bytes gzip, "
          f"{int(statistics.median(r['json_bytes'] for r in rows))} bytes JSON, "
          f"overhead ratios {[r['ratio'] for r in rows]} (None: too noisy or too few steps to tell)")  # fmt: skip
    print(f"load average during the runs: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
