"""What a pipeline-parallel step costs to record and to replay, against the plain step: the tiny Hugging Face Llama
of the tests split into 2 stages (`tests/model_files/pipelines.py`: hidden 32, 4 decoder layers, 2 per stage,
sequences of 8 tokens, a batch of 8 in 4 microbatches of 2 rows, AdamW), `torch.distributed.pipelining`'s 1F1B on 2
ranks under torchrun (gloo, one torch thread per rank).

    python bench/bench_pipeline.py                    # 3 repeats (~2 min on 2 quiet cores)
    python bench/bench_pipeline.py --repeat 5 --schedule gpipe --json out.json

Per rank, in one torchrun launch, after one unrecorded warm-up step (the schedule's shape inference, kernels and
allocator warm), each repeated `--repeat` times from the same weights:
- `plain`: `schedule.step(...)` and the AdamW step without oneiter;
- `record`: the same inside an `oneiter.Recorder` (the reference: every call's tensors per microbatch, every
  transfer between the stages, each microbatch's loss on the last stage), the file written and renamed;
- `replay`: a `Recorder(replay=...)` of that reference from other weights (its weights, AdamW state and batch loaded;
  every call rerun teacher-forced and its noise calibrated, each transfer's received tensor recorded);
- each rank's reference file size.
Seconds are medians over the repeats with [min-max], per rank; on a shared machine one run varies by +-30 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICROBATCHES = 4


def _worker(folder: Path, repeat: int, schedule_name: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    sys.path.insert(0, str(ROOT / "tests" / "model_files"))
    import pipelines

    import oneiter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokens, labels = pipelines.batch(2 * MICROBATCHES)
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule_name]

    def setup(seed: int):
        stage = pipelines.stages(2, [rank], seed=seed)[0]
        schedule = kind(PipelineStage(stage, rank, 2, torch.device("cpu")), MICROBATCHES, loss_fn=pipelines.loss_fn)
        return stage, schedule, torch.optim.AdamW(stage.parameters(), lr=1e-3)

    def step(schedule, opt, rec=None) -> None:
        take = rec.inputs if rec is not None else (lambda t: t)
        if rank == 0:
            schedule.step(take(tokens))
        else:
            schedule.step(target=take(labels), losses=[])
        opt.step()
        opt.zero_grad()

    ref = folder / "ref.h5"

    def once(seed: int, out: Path | None, replay: Path | None = None) -> float:
        """One step timed (inside a Recorder writing `out`, unless None), after the schedule's first step ran."""
        stage, schedule, opt = setup(seed)
        step(schedule, opt)  # the schedule initialised (shape inference), unrecorded
        dist.barrier()
        start = time.perf_counter()
        if out is None:
            step(schedule, opt)
        else:
            with oneiter.Recorder(stage, out, optimizer=opt, replay=replay, force=True) as rec:
                step(schedule, opt, rec)
        return time.perf_counter() - start

    found: dict[str, list[float]] = {"plain": [], "record": [], "replay": []}
    once(0, None)  # warm-up: kernels, allocator
    for _ in range(repeat):
        found["plain"].append(once(0, None))
        found["record"].append(once(0, ref))
        found["replay"].append(once(7, folder / "replay.h5", ref))
    size = (folder / f"ref.rank{rank}.h5").stat().st_size
    (folder / f"result.{rank}.json").write_text(json.dumps({"seconds": found, "file_bytes": size}))
    dist.destroy_process_group()


def _report(folder: Path) -> dict:
    out = {}
    for rank in (0, 1):
        data = json.loads((folder / f"result.{rank}.json").read_text())
        out[rank] = {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                     for name, v in data["seconds"].items()}
        out[rank]["file_mb"] = data["file_bytes"] / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.repeat, args.schedule)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--worker", tmp,
               "--repeat", str(args.repeat), "--schedule", args.schedule]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ONEITER_NO_PROGRESS": "1"}
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        result = _report(Path(tmp))
    print(f"{args.schedule}, 2 stages x 4 microbatches, tiny HF Llama; seconds per step, median [min-max] of "
          f"{args.repeat}")
    for rank, row in result.items():
        cells = "  ".join(f"{name} {row[name]['median']:.2f} [{row[name]['min']:.2f}-{row[name]['max']:.2f}]"
                          for name in ("plain", "record", "replay"))
        print(f"rank {rank}: {cells}  (record {row['record']['median'] / row['plain']['median']:.0f}x, replay "
              f"{row['replay']['median'] / row['plain']['median']:.0f}x plain); reference file {row['file_mb']:.2f} "
              f"MB")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
