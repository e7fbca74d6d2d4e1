"""How long the test suite takes, and how loaded the machine was while it ran.

    python bench/suite_time.py             # the fast loop: pytest -m "not slow"
    python bench/suite_time.py --full      # everything, as .ci/run's pytest runs it
    python bench/suite_time.py --cores 2   # pinned to 2 cores (taskset), as CI's machine has
    python bench/suite_time.py --wait-policy active   # torch's OpenMP threads spinning, as before the suite set
                                                      # OMP_WAIT_POLICY=PASSIVE (tests/conftest.py)

Prints the wall seconds, the CPU seconds of pytest and every process it started (the figure that depends least on
what else runs: a loaded machine stretches the wall time, not the CPU time), the load average before and after
(`os.getloadavg`, 1 minute), the number of tests passed/skipped/failed and the 25 slowest tests. The project's
targets (CONTRIBUTING.md, "Tests"): the full suite under 15 minutes on 2 cores, the fast loop under 5.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole suite (default: -m 'not slow')")
    parser.add_argument("--cores", type=int, default=0, help="pin to this many cores with taskset")
    parser.add_argument("--log", type=Path, default=None, help="also write pytest's output here")
    parser.add_argument("--durations", type=int, default=25, help="how many of the slowest tests pytest lists")
    parser.add_argument("--wait-policy", choices=("passive", "active"), default="passive",
                        help="OMP_WAIT_POLICY for the run (the suite's conftest sets passive unless it is set)")
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--durations={args.durations}"]  # -q: addopts
    if not args.full:
        cmd += ["-m", "not slow"]
    if args.cores and shutil.which("taskset"):
        cmd = ["taskset", "-c", ",".join(map(str, range(args.cores))), *cmd]
    load_before, start = os.getloadavg()[0], time.monotonic()
    env = {**os.environ, "OMP_WAIT_POLICY": args.wait_policy.upper()}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall, load_after = time.monotonic() - start, os.getloadavg()[0]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if args.log:
        args.log.write_text(done.stdout + done.stderr)
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", done.stdout))
    slowest = re.findall(r"^\d+\.\d+s (?:call|setup|teardown) .*$", done.stdout, re.M)
    what = "full suite" if args.full else 'fast loop (-m "not slow")'
    print(f"{what}: {wall:.0f} s wall, "
          f"{usage.ru_utime + usage.ru_stime:.0f} s CPU, load {load_before:.1f} before / {load_after:.1f} after, "
          f"{os.cpu_count()} CPUs{f' (pinned to {args.cores})' if args.cores else ''}; pytest exit {done.returncode}")
    print("tests:", ", ".join(f"{n} {k}" for k, n in counts.items()))
    print(f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}; slowest:", *slowest[:25], sep="\n  ")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
