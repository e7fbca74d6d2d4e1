"""Every 2-D mesh recording `test_meshes.py` judges, from one torchrun launch of 4 ranks:
`python -m torch.distributed.run --nproc-per-node 4 tests/runtime/mesh_run.py DIR`.

- `tp_fsdp`: torchtitan's 2-D layout (`mesh2d.py:build`, layout `fsdp`: tensor parallelism on "tp", FSDP2 on "dp")
  through the CLI's path (`oneiter.record.run.record`, `--data-parallel auto`: nothing to wrap);
- `tp_ddp`: tensor parallelism on "tp" only (layout `tp`), which `--data-parallel auto` wraps in DDP over "dp";
- `pp_ddp`: the tiny HF Llama in 2 pipeline stages on "pp" (`pipelines.py`), each stage in DDP over "dp",
  `Schedule1F1B` with 4 microbatches, recorded by `oneiter.Recorder` around the schedule's step; each data-parallel
  rank has its own batch.

Per layout a reference, a clean replay and a replay with a 0.1 % forward fault in one layer on one rank (CLI:
`--inject-fault ...,rank=1`; pipeline: rank 3's `layers.2.mlp.down_proj`, `faultkit`).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # before a Recorder block begins

MODEL_FILES = Path(__file__).resolve().parent.parent / "model_files"
sys.path.insert(0, str(MODEL_FILES))

import faultkit  # noqa: E402
import pipelines  # noqa: E402

import oneiter  # noqa: E402
from oneiter.record.run import SpecOptions, record  # noqa: E402

CLI_LAYER = "layers.0.feed_forward.w1"


def cli(folder: Path, layout: str) -> None:
    spec, args = str(MODEL_FILES / "mesh2d.py:build"), {"layout": layout}
    record(SpecOptions(out=folder / "ref.h5", model=spec, batch_size=4, model_args=args))
    record(SpecOptions(out=folder / "clean.h5", replay=folder / "ref.h5", model=spec, model_args=args))
    record(SpecOptions(out=folder / "layer.h5", replay=folder / "ref.h5", model=spec, model_args=args,
                       faults=[f"{CLI_LAYER},rank=1"]))


def pipeline_step(out: Path, replay: Path | None = None, fault: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage = pipelines.stages(2, [pp], seed=0 if replay is None else 7)[0]
    if fault and dist.get_rank() == 3:
        os.environ[faultkit.ENV] = "instance:layers.2.mlp.down_proj"
        faultkit.apply_fault(stage)
        os.environ.pop(faultkit.ENV)
    wrapped = DistributedDataParallel(stage, process_group=mesh["dp"].get_group())
    schedule = Schedule1F1B(PipelineStage(wrapped, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group()), 4,
                            loss_fn=pipelines.loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    tokens, labels = pipelines.batch(8, seed=5 + dp)
    try:
        with oneiter.Recorder(wrapped, out, optimizer=opt, replay=replay) as rec:
            if pp == 0:
                schedule.step(rec.inputs(tokens))
            else:
                schedule.step(target=rec.inputs(labels), losses=[])
            opt.step()
    finally:
        faultkit.undo_faults()


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    for layout, name in (("fsdp", "tp_fsdp"), ("tp", "tp_ddp")):
        (folder / name).mkdir(exist_ok=True)
        cli(folder / name, layout)
    out = folder / "pp_ddp"
    out.mkdir(exist_ok=True)
    pipeline_step(out / "ref.h5")
    pipeline_step(out / "clean.h5", out / "ref.h5")
    pipeline_step(out / "layer.h5", out / "ref.h5", fault=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
