"""Every two-rank FSDP2 recording `test_fsdp2.py` judges, made in one `torchrun --nproc-per-node 2` launch (a launch
costs seconds of start-up): `python -m torch.distributed.run --nproc-per-node 2 tests/runtime/fsdp2_run.py DIR`.

- the CLI's path (`oneiter.record.run.record`, what `torchrun -m oneiter record` runs) on `sharded.py`, a model
  that shards itself: a reference, a clean replay with every block checkpointed, a replay with a forward fault on
  rank 1 only;
- `oneiter.Recorder` in a hand-written loop over the same model sharded by hand (AdamW): a reference, a clean
  replay, a replay with a backward fault on rank 1 only.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODEL_FILES = Path(__file__).resolve().parent.parent / "model_files"
sys.path.insert(0, str(MODEL_FILES))

import sharded  # noqa: E402

import oneiter  # noqa: E402
from oneiter.record.modes.faults import attach_faults, parse_fault  # noqa: E402
from oneiter.record.run import SpecOptions, record  # noqa: E402


def loop(out: Path, seed: int, replay: Path | None = None, fault: str | None = None) -> None:
    """One iteration of a hand-written training loop, recorded."""
    torch.manual_seed(seed)
    model = sharded.shard(sharded.Sharded())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    handles = attach_faults(model, [parse_fault(fault)]) if fault else []
    with oneiter.Recorder(model, out, optimizer=opt, replay=replay) as rec:
        x, y = rec.inputs(x, y)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    for handle in handles:
        handle.remove()


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = f"{MODEL_FILES / 'sharded.py'}:build"
    record(SpecOptions(out=folder / "ref.h5", model=spec, batch_size=2))
    record(SpecOptions(out=folder / "clean.h5", replay=folder / "ref.h5", model=spec, seed=3,
                       model_args={"checkpointing": "non_reentrant"}))
    record(SpecOptions(out=folder / "fault.h5", replay=folder / "ref.h5", model=spec, faults=["blocks.1.up,rank=1"]))
    loop(folder / "loop_ref.h5", seed=rank)
    loop(folder / "loop_clean.h5", seed=10 + rank, replay=folder / "loop_ref.h5")
    loop(folder / "loop_fault.h5", seed=10 + rank, replay=folder / "loop_ref.h5",
         fault="blocks.0.down:backward" if rank == 1 else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
