"""Benchmark record/compare on a built-in model (default: resnet18, batch 8, 224x224), each step in its own process.

    python bench/bench_record.py [--model resnet18] [--batch-size 8] [--dir /tmp/oneiter-bench]

Prints: plain iteration seconds (median of 3 after a warm-up, and the cold first one), record seconds (the whole `record()` call: model
build, one iteration with capture, file written and renamed; `import torch` excluded, ~2 s), file bytes, peak RSS of the
plain and of the recording process, the replay's record seconds without and with isolated (teacher-forced)
per-layer reruns, and compare seconds. Peak RSS is each child's own ru_maxrss, so it includes
torch itself (~0.3 GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PLAIN = """
import json, statistics, time, torch
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.training import prepare, train_step
bundle = load_model({model!r}, {batch}, 0, {{}})
setup = prepare(bundle, torch.device("cpu"))
times = []
for _ in range(4):
    t0 = time.perf_counter(); train_step(setup); times.append(time.perf_counter() - t0)
print(json.dumps({{"plain_seconds": statistics.median(times[1:]), "plain_first_iteration_seconds": times[0]}}))
"""

RECORD = """
import json, time
from pathlib import Path
import torch  # imported before the clock starts, as the plain measurement does
from oneiter.record import capture, randomness, recorder, session  # imported before the clock starts
from oneiter.record.run import RecordOptions, record
t0 = time.perf_counter()
s = record(RecordOptions(out=Path({out!r}), model={model!r}, batch_size={batch}, force=True{extra}))
print(json.dumps({{"record_seconds": time.perf_counter() - t0, "iteration_seconds_in_record": s.seconds,
                  "file_bytes": s.file_bytes, "tensor_bytes": s.num_bytes, "entries": s.num_entries}}))
"""

COMPARE = """
import json, time
from oneiter.judge.engine import compare_files
t0 = time.perf_counter()
r = compare_files({a!r}, {b!r})
print(json.dumps({{"compare_seconds": time.perf_counter() - t0, "status": r.status}}))
"""


PEAK = """
import resource
print(json.dumps({"peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def run_child(code: str) -> tuple[dict, float]:
    """Run `code` in a fresh interpreter; returns its JSON result and its own peak RSS in MB."""
    proc = subprocess.run([sys.executable, "-c", code + PEAK], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"benchmark step failed:\n{proc.stderr}")
    *_, result, peak = proc.stdout.strip().splitlines()
    return json.loads(result), json.loads(peak)["peak_kb"] / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dir", default="/tmp/oneiter-bench")
    args = parser.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": args.model, "batch_size": args.batch_size}

    plain, plain_mb = run_child(PLAIN.format(model=args.model, batch=args.batch_size))
    results.update(plain, plain_peak_rss_mb=round(plain_mb))
    ref, tgt = str(work / "ref.h5"), str(work / "tgt.h5")
    rec, rec_mb = run_child(RECORD.format(out=ref, model=args.model, batch=args.batch_size, extra=""))
    results.update(rec, record_peak_rss_mb=round(rec_mb))
    plain_replay = str(work / "tgt_no_isolate.h5")
    rep, _ = run_child(RECORD.format(out=plain_replay, model=args.model, batch=args.batch_size,
                                     extra=f", replay=Path({ref!r}), isolate=False"))
    results["replay_no_isolate_record_seconds"] = rep["record_seconds"]
    rep, rep_mb = run_child(RECORD.format(out=tgt, model=args.model, batch=args.batch_size,
                                          extra=f", replay=Path({ref!r})"))
    results.update(replay_isolate_record_seconds=rep["record_seconds"], replay_isolate_file_bytes=rep["file_bytes"],
                   replay_isolate_peak_rss_mb=round(rep_mb))
    cmp_, cmp_mb = run_child(COMPARE.format(a=ref, b=tgt))
    results.update(cmp_, compare_peak_rss_mb=round(cmp_mb))
    for key, value in results.items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
