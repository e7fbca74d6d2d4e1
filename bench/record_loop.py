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

    import torch

    from oneiter.record.recorder import Recorder
    from oneiter.runtime.modelspec import load_model
    from oneiter.runtime.training import prepare, train_step

    setup = prepare(load_model(args.model, args.batch_size, 0, json.loads(args.model_args)), torch.device("cpu"))
    model = setup.bundle.model
    setup.bundle.loss_fn(model(*setup.inputs)).backward()  # warm: kernels and allocator; weights unchanged
    setup.optimizer.zero_grad(set_to_none=True)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = setup.inputs
    for run in range(args.runs):
        model.load_state_dict(start)  # the same iteration again: weights, gradients, optimizer state (momentum)
        setup.optimizer.zero_grad(set_to_none=True)
        setup.optimizer.state.clear()
        setup.inputs = inputs
        args.out.unlink(missing_ok=True)
        os.sync()
        t0 = time.perf_counter()
        with Recorder(model, args.out, optimizer=setup.optimizer, replay=args.replay, isolate=not args.no_isolate,
                      level=args.level, force=True) as rec:
            batch = rec.inputs(*setup.inputs)
            setup.inputs = batch if len(inputs) != 1 else (batch,)
            train_step(setup)
        print(f"record {run + 1}: {time.perf_counter() - t0:.3f} s, {rec.summary.file_bytes / 1e6:,.1f} MB",
              flush=True)
    setup.inputs = inputs
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        train_step(setup)
        times.append(time.perf_counter() - t0)
    print(f"plain iteration: {sorted(times)[1]:.3f} s (median of 3)")
    args.out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
