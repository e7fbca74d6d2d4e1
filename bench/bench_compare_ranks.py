"""Compare at cluster scale: `torchrun --nproc-per-node P -m oneiter compare REF TGT` over many small rank-file pairs,
for P = 1, 2, 4, against plain `oneiter compare` (one process that judges the pairs in a pool of one worker per
CPU): wall seconds, the largest process's peak RSS, and whether every run gives the same verdict.

    python bench/bench_compare_ranks.py [--ranks 256] [--procs 1,2,4] [--folder DIR]

The rank files are `tests/runtime/rank_files.py`'s (a 2-layer MLP recorded once, copied per rank, ranks 173 and 201
of the target made wrong). Each command runs in its own child; the peak RSS is the largest `ru_maxrss` among that
child's descendants (torchrun's workers, or the pool's), so it is per process, not summed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from rank_files import make_ranks  # noqa: E402


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _measure(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB of the largest descendant, exit code) of `cmd`, run in a fresh child that
    reports its own children's usage."""
    probe = ("import resource, subprocess, sys, time, json; t = time.perf_counter(); "
             "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
             "print(json.dumps([time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc]))")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True,
                         env={**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}, check=True)
    seconds, kb, rc = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, kb / 1024, rc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="oneiter-ranks-"))
    folder.mkdir(parents=True, exist_ok=True)
    ref, tgt = make_ranks(folder, args.ranks, diverged=(173 % args.ranks, 201 % args.ranks))
    oneiter = [sys.executable, "-m", "oneiter", "compare", str(ref), str(tgt)]
    verdicts = {}
    runs = [("oneiter compare (pool)", None)] + [(f"torchrun --nproc-per-node {p}", int(p))
                                                 for p in args.procs.split(",")]
    print(f"{args.ranks} rank-file pairs in {folder}; {os.cpu_count()} CPUs")
    for label, procs in runs:
        out = folder / f"verdict_{procs or 'pool'}.json"
        cmd = [*oneiter, "--json", str(out)]
        if procs is not None:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-addr",
                   "127.0.0.1", "--master-port", str(_port()), *cmd[1:]]
        seconds, mb, rc = _measure(cmd)
        verdict = json.loads(out.read_text())
        verdicts[label] = (verdict["verdict"], verdict["ranks"])
        print(f"{label:28s} {seconds:7.1f} s   peak RSS per process {mb:6.0f} MB   exit {rc}   "
              f"{verdict['verdict']['headline'][:70]}")
    same = len({json.dumps(v, sort_keys=True) for v in verdicts.values()}) == 1
    print(f"same verdict and per-rank verdicts in every run: {same}")


if __name__ == "__main__":
    main()
