"""What recording a compiled model costs: compile seconds and record seconds, against the same model run eagerly.

For each model — the CNN of tests/model_files/functional_cnn.py (through compiled.py) and the tiny Hugging Face
Llama of tests/model_files/hf_llama.py, batch 2 — an eager reference is recorded, then each of these in a fresh
process, replaying it with local blame (every call rerun, calibrated):
- `eager`: the eager replay (`record --replay`);
- `inductor cold`: `record --replay --compile` (inductor), its cache (`TORCHINDUCTOR_CACHE_DIR`) a new folder
  (each repeat its own);
- `inductor warm`: the same again on the last cold run's cache (inductor's FX-graph cache hits; Dynamo traces anew).
Per run: `record` s (the whole `record()` call, what `oneiter record` prints; compiling excluded), `block` s (the
Recorder block: the iteration, its reruns and writes; compiling excluded), `compile` s (torch compiling, the
iteration's own calls and the reruns'), and the process's wall seconds.

    python bench/bench_compiled.py                     # both models
    python bench/bench_compiled.py --models llama --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ROOT / "tests" / "model_files"
MODELS = {
    "cnn": (str(FILES / "compiled.py:build"), {"how": "eager"}),
    "llama": (str(FILES / "hf_llama.py:build"), {}),
}


def _one(args: dict) -> None:
    """In a fresh process: one record(), its summary as one JSON line."""
    from oneiter.record.run import SpecOptions, record

    summary = record(SpecOptions(**{**args, "out": Path(args["out"]),
                                    "replay": Path(args["replay"]) if args.get("replay") else None}))
    print(json.dumps({"record": summary.seconds, "block": summary.iteration_seconds,
                      "compile": summary.compile_seconds}))


def _run(args: dict, env: dict) -> dict:
    started = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--one", json.dumps(args)], env=env, capture_output=True,
                         text=True, check=False)
    if res.returncode:
        raise SystemExit(f"failed: {args}\n{res.stderr[-3000:]}")
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "wall": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,llama")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        _one(json.loads(opts.one))
        return
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name in opts.models.split(","):
        spec, model_args = MODELS[name]
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "ONEITER_NO_PROGRESS": "1"}
            ref = str(Path(folder) / "ref.h5")
            base = {"model": spec, "batch_size": 2}
            _run({**base, "out": ref, "model_args": model_args}, env)
            # the inductor cache of a run: a new folder for each cold repeat; the warm runs reuse the last one
            runs = [("eager", {}, lambda k: None), ("inductor cold", {"compile": "inductor"}, lambda k: k)]
            runs += [("inductor warm", {"compile": "inductor"}, lambda k: opts.repeat - 1)]
            for label, extra, cache in runs:
                for k in range(opts.repeat):
                    out = str(Path(folder) / f"{label.replace(' ', '_')}{k}.h5")
                    which = cache(k)
                    run_env = env if which is None else {
                        **env, "TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / f"inductor-cache{which}")}
                    got = _run({"model": spec, "out": out, "replay": ref, **extra}, run_env)
                    print(f"{name:6s} {label:14s} record {got['record']:7.2f} s  block {got['block']:7.2f} s  "
                          f"compile {got['compile']:7.2f} s  wall {got['wall']:7.2f} s", flush=True)


if __name__ == "__main__":
    main()
