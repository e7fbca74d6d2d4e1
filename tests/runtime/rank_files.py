"""Many small rank files for compare at cluster scale (tests/runtime/test_parallel.py, bench/bench_compare_ranks.py).

`make_ranks(folder, n, diverged)` records a 2-layer MLP once in this process through `oneiter.Recorder` — a
reference and a teacher-forced replay of it — and copies each into `ref/run.rank<R>.h5` and `tgt/run.rank<R>.h5`
for R = 0..n-1, each copy's `rank` and `world_size` set as torchrun's rank R of n would have written them. In the
copies of the ranks in `diverged`, the first call's forward output is scaled by 1.01: a value its own code did not
compute, which the judge names on that rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import torch
import torch.nn as nn
import torch.nn.functional as F


def _record(out: Path, replay: Path | None = None) -> None:
    import oneiter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with oneiter.Recorder(model, out, optimizer=opt, replay=replay) as rec:
        x, y = rec.inputs(x, y)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def make_ranks(folder: Path, n: int, diverged: tuple[int, ...] = ()) -> tuple[Path, Path]:
    """`folder/ref` and `folder/tgt`, each holding `run.rank<R>.h5` for R < n (module docstring)."""
    folder = Path(folder)
    base_ref, base_tgt = folder / "base_ref.h5", folder / "base_tgt.h5"
    _record(base_ref)
    _record(base_tgt, replay=base_ref)
    for side, base in (("ref", base_ref), ("tgt", base_tgt)):
        (folder / side).mkdir(exist_ok=True)
        for rank in range(n):
            path = folder / side / f"run.rank{rank}.h5"
            shutil.copyfile(base, path)
            with h5py.File(path, "r+") as f:
                f.attrs["rank"], f.attrs["world_size"] = rank, n
                if side == "tgt" and rank in diverged:
                    f["calls/0@0/forward/output"][...] *= 1.01
    return folder / "ref", folder / "tgt"
