"""Mutation fuzzing of the readers: how many hostile copies of a recording each category tried, and what happened.

    python bench/mutations.py [--examples 200] [--timeout 20] [--dir /tmp/oneiter-mutations]

Uses the generators of tests/format/mutants.py (the ones tests/format/test_mutations.py runs in-process, 1,239
examples in all) with `--examples` per category, and checks every mutant in a forked child, so that a crash of
the HDF5 library (a signal) or a hang inside C code is counted rather than taking the run down. Per mutant:
`compare REF MUTANT`, `inspect MUTANT` and the replay read path (`mutants.check`; `limits`: `replay --layer`
too). Prints one row per category: cases tried; of the clean outcomes (exit 0/1/2, one line on stderr for 2) those
refused (compare exit 2), judged (exit 1) and matched (exit 0, where the mutation changed nothing judged);
tracebacks (exit 3, an escaping exception, a traceback or several lines on stderr); false matches (exit 0 after a
mutation that changed what is judged or forged a structure: `mutants.MUST_NOT_MATCH`); hangs (over `--timeout`
seconds); crashes (the child died of a signal). Hypothesis stops a category early when its space of distinct
mutations is exhausted, so "tried" may be below `--examples`.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "format")]
os.environ.setdefault("ONEITER_NO_PROGRESS", "1")

import mutants  # noqa: E402


def run_forked(pair, mutation, mutant: Path, timeout: float) -> str:
    """The outcome of `mutants.check` run in a forked child: refused, judged, matched, traceback, false_match, hang
    or crash."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: check, report one word, leave without cleanup
        os.close(read_end)
        try:
            found = mutants.check(pair, mutation, mutant, timeout=timeout)
            word = mutants.outcome(found)
            if word == "clean":
                word = {2: "refused", 1: "judged"}.get(found.get("compare_exit"), "matched")
        except BaseException:  # noqa: BLE001
            word = "traceback"
        os.write(write_end, word.encode())
        os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], timeout + 5)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
        return "hang"
    word = os.read(read_end, 64).decode()
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) or not word:
        return "crash"
    return word


def run_category(pair, category: str, examples: int, timeout: float, scratch: Path) -> collections.Counter:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tally: collections.Counter = collections.Counter()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data):
        mutation = data.draw(mutants.strategy(pair, category))
        folder = Path(tempfile.mkdtemp(dir=scratch))
        mutant = mutants.apply(pair, mutation, folder / "mutant.h5", folder)
        tally[run_forked(pair, mutation, mutant, timeout)] += 1

    one()
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="mutations per category")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per mutant before it counts as a hang")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="oneiter-mutations-"))
    scratch.mkdir(parents=True, exist_ok=True)
    pair = mutants.make_pair(scratch)
    mutants._cli("inspect", pair.ref)  # warm up (imports) before forking
    columns = ("tried", "refused", "judged", "matched", "traceback", "false_match", "hang", "crash")
    print(f"{'category':18} " + " ".join(f"{c:>11}" for c in columns) + "  seconds")
    totals: collections.Counter = collections.Counter()
    for category in mutants.CATEGORIES:
        started = time.monotonic()
        tally = run_category(pair, category, args.examples, args.timeout, scratch)
        tally["tried"] = sum(tally.values())
        totals.update(tally)
        print(f"{category:18} " + " ".join(f"{tally[c]:>11}" for c in columns)
              + f"  {time.monotonic() - started:7.1f}", flush=True)
    print(f"{'total':18} " + " ".join(f"{totals[c]:>11}" for c in columns))


if __name__ == "__main__":
    main()
