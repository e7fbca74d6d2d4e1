"""Pipeline-parallel recordings for `test_pipelines.py`, all from one torchrun launch of 2 ranks:
`python -m torch.distributed.run --nproc-per-node 2 tests/runtime/pipeline_run.py DIR`.

Through `oneiter.Recorder` in the training loop, the tiny HF Llama split into stages the torchtitan way
  (`pipelines.py`), 4 microbatches: `torch.distributed.pipelining`'s GPipe, 1F1B and interleaved 1F1B (2 stages per
  rank), and a Megatron-style 1F1B written by hand with `dist.send`/`dist.recv` (`megatron`) and with
  `batch_isend_irecv` (`megatron_async`). Per schedule a reference, a clean replay built from other weights, a
  replay with a 0.1 % forward fault in a layer of rank 1's first stage (`faultkit`: `layers.2.mlp.down_proj`; the
  interleaved schedule's stage 1: `1.layers.1.mlp.down_proj`), and for 1F1B and `megatron`
  one whose point-to-point library corrupts rank 0's third floating-point send (`faulty_p2p`). Then, through the
  CLI's path, `ring_exchange.py` (isend/irecv inside a layer's forward and backward): reference, clean replay, a
  corrupted send. (What must fail: `pipeline_failures.py`.)
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (  # before a Recorder block begins: it wraps what the program loaded
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

MODEL_FILES = Path(__file__).resolve().parent.parent / "model_files"
sys.path.insert(0, str(MODEL_FILES))

import faultkit  # noqa: E402
import faulty_p2p  # noqa: E402
import pipelines  # noqa: E402

import oneiter  # noqa: E402
from oneiter.record.run import SpecOptions, record  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "megatron", "megatron_async")
P2P_FAULTS = ("1f1b", "megatron")  # the schedules replayed with a corrupted send too
# the layer a 0.1 % forward fault hits on rank 1: its first stage's (stage 1: layers 2 and 3 of 2 stages; stage 1 of
# the interleaved 4, layer 1)
LAYER_FAULTS = {"interleaved": "instance:1.layers.1.mlp.down_proj"}
LAYER_FAULT = "instance:layers.2.mlp.down_proj"
MICROBATCHES = 4


def _stages(name: str, rank: int, world: int, seed: int, fault: str = ""):
    """This rank's stage ids, their modules, and the model a Recorder is given: the one stage, or (2 stages per rank)
    a ModuleDict of them by stage id. `fault`: a `faultkit` spec applied to that model."""
    per = 2 if name == "interleaved" else 1
    ids = [rank + world * k for k in range(per)]
    parts = pipelines.stages(world * per, ids, seed=seed)
    model = parts[0] if per == 1 else torch.nn.ModuleDict({str(i): p for i, p in zip(ids, parts, strict=True)})
    if fault:
        os.environ[faultkit.ENV] = fault
        try:
            faultkit.apply_fault(model)
        finally:
            os.environ.pop(faultkit.ENV, None)
    return ids, parts, model


def _schedule(name: str, ids: list[int], parts: list, world: int, loss_fn=pipelines.loss_fn):
    total = world * len(parts)
    stages = [PipelineStage(p, s, total, torch.device("cpu")) for p, s in zip(parts, ids, strict=True)]
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
    return kinds[name](stages if len(stages) > 1 else stages[0], MICROBATCHES, loss_fn=loss_fn)


def run(name: str, out: Path, replay: Path | None = None, fault: str = "", p2p: bool = False, loss_fn=None):
    """One recording of schedule `name` (module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, parts, model = _stages(name, rank, world, seed=0 if replay is None else 7, fault=fault if rank == 1 else "")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, labels = pipelines.batch(8)
    if p2p:
        faulty_p2p.install(rank=0, nth=2)
    try:
        with oneiter.Recorder(model, out, optimizer=opt, replay=replay) as rec:
            if name.startswith("megatron"):
                data = list((tokens if rank == 0 else labels).chunk(MICROBATCHES))
                pipelines.megatron_1f1b(model, rank, world, data, take=rec.inputs,
                                        p2p="async" if name.endswith("async") else "blocking",
                                        hidden_shape=(8 // MICROBATCHES, tokens.shape[1], 32))
            else:
                schedule = _schedule(name, ids, parts, world, loss_fn or pipelines.loss_fn)
                if rank == 0:
                    schedule.step(rec.inputs(tokens))
                else:
                    schedule.step(target=rec.inputs(labels), losses=[])
            opt.step()
    finally:
        faulty_p2p.uninstall()
        faultkit.undo_faults()


def record_all(folder: Path) -> None:
    for name in SCHEDULES:
        out = folder / name
        out.mkdir(exist_ok=True)
        run(name, out / "ref.h5")
        run(name, out / "clean.h5", out / "ref.h5")
        run(name, out / "layer.h5", out / "ref.h5", fault=LAYER_FAULTS.get(name, LAYER_FAULT))
        if name in P2P_FAULTS:
            run(name, out / "p2p.h5", out / "ref.h5", p2p=True)
    out = folder / "ring"
    out.mkdir(exist_ok=True)
    spec = str(MODEL_FILES / "ring_exchange.py:build")
    record(SpecOptions(out=out / "ref.h5", model=spec, batch_size=4, data_parallel="none"))
    record(SpecOptions(out=out / "clean.h5", replay=out / "ref.h5", model=spec, data_parallel="none"))
    record(SpecOptions(out=out / "p2p.h5", replay=out / "ref.h5", model=spec, data_parallel="none",
                       model_args={"p2p_fault": 0}))
    faulty_p2p.uninstall()


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    record_all(folder)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
