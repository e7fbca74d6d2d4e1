"""Record the same iteration several times in one warm process: each run's seconds, then the plain iteration's.

    python bench/record_loop.py --level stats --runs 6
    python bench/record_loop.py --runs 4 --replay /tmp/ref.h5            # isolated replays of a reference
    py-spy record -r 250 -f raw -o rec.txt -- python bench/record_loop.py --runs 8   # where the time goes

What `bench_record.py` measures once per fresh process, this repeats in one process (the model's state restored,
the previous output removed and `os.sync()` run before each record, outside the clock), so a profiler sees many
records and the figures are free of `import torch` and of a fresh process's first page faults. The first run is
the coldest; later ones write into pages the previous output freed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def prepared(model: str, batch_size: int, model_args: dict):
    """The model's training setup on the CPU, warm: one forward and backward ran (kernels and allocator), no
    optimizer step (the weights are unchanged)."""
    import torch

    from oneiter.runtime.modelspec import load_model
    from oneiter.runtime.training import prepare

    setup = prepare(load_model(model, batch_size, 0, model_args), torch.device("cpu"))
    setup.bundle.loss_fn(setup.bundle.model(*setup.inputs)).backward()
    setup.optimizer.zero_grad(set_to_none=True)
    return setup


def records(setup, out: Path, runs: int, **recorder_kwargs):
    """Record `setup`'s iteration `runs` times into `out`, yielding each record's (seconds, summary). Before each
    (outside the clock) the same iteration is restored — weights, gradients, the optimizer's state (momentum) —
    the previous output removed and `os.sync()` run. The starting weights wait on disk: a copy in memory would
    count in the process's peak RSS."""
    import torch

    from oneiter.record.recorder import Recorder
    from oneiter.runtime.training import train_step

    model, inputs = setup.bundle.model, setup.inputs
    start = out.with_suffix(".start.pt")
    torch.save(model.state_dict(), start)
    try:
        for run in range(runs):
            if run:
                model.load_state_dict(torch.load(start))
                setup.optimizer.zero_grad(set_to_none=True)
                setup.optimizer.state.clear()
            setup.inputs = inputs
            out.unlink(missing_ok=True)
            os.sync()
            t0 = time.perf_counter()
            with Recorder(model, out, optimizer=setup.optimizer, force=True, **recorder_kwargs) as rec:
                batch = rec.inputs(*setup.inputs)
                setup.inputs = batch if len(inputs) != 1 else (batch,)
                train_step(setup)
            yield time.perf_counter() - t0, rec.summary
    finally:
        setup.inputs = inputs
        start.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model-args", default="{}", help="the builder's keyword arguments (JSON)")
    parser.add_argument("--level", default="full", choices=("full", "stats"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--replay", type=Path, help="a reference recording to replay")
    parser.add_argument("--no-isolate", action="store_true", help="with --replay: no teacher-forced reruns")
    parser.add_argument("--out", type=Path, default=Path("/tmp/oneiter-record-loop.h5"))
    args = parser.parse_args()

    from oneiter.runtime.training import train_step

    setup = prepared(args.model, args.batch_size, json.loads(args.model_args))
    runs = records(setup, args.out, args.runs, replay=args.replay, isolate=not args.no_isolate, level=args.level)
    for run, (seconds, summary) in enumerate(runs):
        print(f"record {run + 1}: {seconds:.3f} s, {summary.file_bytes / 1e6:,.1f} MB", flush=True)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        train_step(setup)
        times.append(time.perf_counter() - t0)
    print(f"plain iteration: {sorted(times)[1]:.3f} s (median of 3)")
    args.out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
