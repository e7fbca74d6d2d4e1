"""The feature matrix with each cell's seconds: {one process, DDP, FSDP2, tensor parallelism} x {--steps, --compile
--compile-modules, --level stats, bf16 autocast, activation checkpointing}, as `tests/runtime/test_feature_matrix.py`
records and judges it.

    python bench/feature_matrix.py                     # both launches, then the table
    python bench/feature_matrix.py --folder /tmp/fm    # keep the recordings there

The recordings are `tests/runtime/matrix_run.py`'s: one process for `one`, one `torchrun --nproc-per-node 2` launch for
the three others. A cell's seconds are the wall time of its two `oneiter record` replays (clean, then a fault in
`blocks.1.up`), the slowest rank's; the reference row is the two references (one iteration, `--steps 4`). Each cell
then shows its verdicts, clean / fault, per rank: `match`, or what the fault's comparison names (module, or `step S`),
and `refused` with its one line for a cell that cannot work. Also printed: the launches' wall time and the load
average (these cores are shared: figures are what they were then).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "runtime" / "matrix_run.py"
sys.path.insert(0, str(RUN.parent))
import matrix_run  # noqa: E402

RUNS = ("one", "ddp", "fsdp2", "tp")
COLUMNS = ("reference", "steps", *matrix_run.FEATURES)


def _launch(folder: Path, runs: list[str]) -> float:
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    if runs == ["one"]:
        cmd = [sys.executable, str(RUN), str(folder), "one"]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), str(RUN), str(folder), *runs]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(runs)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def _verdict(folder: Path, run: str, feature: str, kind: str) -> str:
    import oneiter

    ref = "steps_ref" if feature == "steps" else "ref"
    found = []
    for suffix in ([".h5"] if run == "one" else [".rank0.h5", ".rank1.h5"]):
        v = oneiter.compare(folder / f"{ref}{suffix}", folder / f"{feature}_{kind}{suffix}").verdict()
        found.append("match" if v["status"] == "match" else f"step {v['step']}" if v.get("step") is not None
                     else f"{v['module']} {v['phase']}")
    return "/".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="feature_matrix_"))
    walls = {"one": _launch(folder, ["one"]), "ddp fsdp2 tp": _launch(folder, ["ddp", "fsdp2", "tp"])}
    print(f"load average {os.getloadavg()[0]:.1f}; launches: " +
          ", ".join(f"{name} {seconds:.1f} s" for name, seconds in walls.items()))
    print(f"{'':6} " + " ".join(f"{c:>13}" for c in COLUMNS))
    refused: dict[tuple[str, str], str] = {}
    for run in RUNS:
        cells = [json.loads(p.read_text()) for p in sorted((folder / run).glob("cells.rank*.json"))]
        row = []
        for column in COLUMNS:
            errors = sorted({r["error"] for c in cells for r in c[column]["runs"] if r["code"]})
            if errors:
                refused[run, column] = errors[0]
            row.append(f"{max(c[column]['seconds'] for c in cells):6.1f} s{'*' if errors else ' '}")
        print(f"{run:6} " + " ".join(f"{cell:>13}" for cell in row))
    print("(* refused up front, below)\n\nverdicts (clean | fault; per rank, rank 0/rank 1):")
    for run in RUNS:
        for column in COLUMNS[1:]:
            if (run, column) in refused:
                continue
            print(f"  {run:6} {column:14} {_verdict(folder / run, run, column, 'clean'):>24} | "
                  f"{_verdict(folder / run, run, column, 'fault')}")
    for (run, column), line in refused.items():
        print(f"refused: {run} x {column}: {line}")
    print(f"recordings in {folder}")


if __name__ == "__main__":
    main()
