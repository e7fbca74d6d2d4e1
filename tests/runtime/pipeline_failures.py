"""What must fail in a recorded pipeline, for `test_pipelines.py`: one torchrun launch of 2 ranks per case,
`python -m torch.distributed.run --nproc-per-node 2 tests/runtime/pipeline_failures.py DIR CASE`, over a 2-stage MLP
(each rank's stage of 2 `nn.Linear` layers), 4 microbatches:

- `error`: GPipe with a loss function that raises in microbatch 2 on rank 1, while rank 0 waits for that stage's
  gradients;
- `stall`: rank 1 never sends what rank 0 receives (run with a short `ONEITER_DIST_TIMEOUT`);
- `zero_bubble`: `ScheduleInterleavedZeroBubble` (2 stages per rank), which a recording cannot hold.

Nothing is written; the test reads each launch's exit, time and output.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleavedZeroBubble

import oneiter


def _stage(index: int) -> nn.Module:
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _loss(out, target, calls=[0]):  # noqa: B006 - counts this process's calls
    calls[0] += 1
    if dist.get_rank() == 1 and calls[0] == 3:
        raise ValueError("the loss function failed on microbatch 2")
    return ((out - target) ** 2).mean()


def _step(stages: list[int], schedule_class, folder: Path) -> None:
    rank, total = dist.get_rank(), 2 * len(stages)
    parts = [_stage(s) for s in stages]
    model = parts[0] if len(parts) == 1 else nn.ModuleDict({str(s): p for s, p in zip(stages, parts, strict=True)})
    built = [PipelineStage(p, s, total, torch.device("cpu")) for p, s in zip(parts, stages, strict=True)]
    schedule = schedule_class(built if len(built) > 1 else built[0], 4, loss_fn=_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with oneiter.Recorder(model, folder / "run.h5") as rec:
        if rank == 0:
            schedule.step(rec.inputs(x))
        else:
            schedule.step(target=rec.inputs(y), losses=[])


def _stall(folder: Path) -> None:
    model = nn.Linear(4, 4)
    with oneiter.Recorder(model, folder / "stall.h5") as rec:
        out = model(rec.inputs(torch.randn(2, 4)))
        if dist.get_rank() == 0:
            dist.recv(torch.empty(2, 4), 1)
        else:
            time.sleep(60)
        out.sum().backward()


def main(folder: Path, case: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if case == "error":
        _step([rank], ScheduleGPipe, folder)
    elif case == "stall":
        _stall(folder)
    elif case == "zero_bubble":
        _step([rank, rank + 2], ScheduleInterleavedZeroBubble, folder)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
