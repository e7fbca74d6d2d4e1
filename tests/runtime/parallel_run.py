"""Every multi-rank recording `test_parallel.py` judges for one world size, made in one torchrun launch (a launch costs
seconds of start-up): `python -m torch.distributed.run --nproc-per-node W tests/runtime/parallel_run.py DIR [steps]`.

For each model that parallelises itself — `tensor_parallel.py:build` (Megatron-style, by hand),
`tensor_parallel.py:build_dtensor` (`torch.distributed.tensor.parallel`), `moe_a2a.py:build` (2 experts, all-to-all
dispatch) — through the CLI's path (`oneiter.record.run.record`): a reference, a clean replay, a replay with a
forward fault in one layer on rank 1, and replays whose collective library is wrong (`faulty_collectives.py`,
installed by the model's builder from its model arguments; with 2 ranks one of them at `--level stats` too). With
`steps`: `tensor_parallel.py:build_steps` recorded for 3 steps, and replayed with rank 1's `inp` layer wrong from
step 2 on; and the Megatron-style model recorded with `data_parallel="ddp"` (wrapped in DDP all the same)."""

import sys
from pathlib import Path

import torch.distributed as dist

MODEL_FILES = Path(__file__).resolve().parent.parent / "model_files"
sys.path.insert(0, str(MODEL_FILES))

from oneiter.record.run import SpecOptions, record  # noqa: E402

MODELS = {  # name -> (spec, the layer a fault hits on rank 1)
    "megatron": ("tensor_parallel.py:build", "blocks.0.fc1"),
    "dtensor": ("tensor_parallel.py:build_dtensor", "layers.0.feed_forward.w1"),
    "moe": ("moe_a2a.py:build", "moe.experts.0.up"),
}
# collective faults per world size and model: replay name -> model arguments
FAULTS = {
    2: {"megatron": {"offset": {"collective_fault": "offset"}, "bf16": {"collective_fault": "bf16"},
                     "drop": {"collective_fault": "drop", "fault_min_numel": 32}},
        "dtensor": {"offset": {"collective_fault": "offset"}},
        "moe": {"offset": {"collective_fault": "offset"}}},
    4: {"megatron": {"drop": {"collective_fault": "drop", "fault_min_numel": 32}},
        "dtensor": {"bf16": {"collective_fault": "bf16"}},
        "moe": {"offset": {"collective_fault": "offset"}}},
}


def main(folder: Path, steps: bool) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for name, (spec, layer) in MODELS.items():
        out, spec = folder / name, str(MODEL_FILES / spec)
        out.mkdir(exist_ok=True)
        record(SpecOptions(out=out / "ref.h5", model=spec, batch_size=4))
        record(SpecOptions(out=out / "clean.h5", replay=out / "ref.h5", model=spec))
        record(SpecOptions(out=out / "layer.h5", replay=out / "ref.h5", model=spec, faults=[f"{layer},rank=1"]))
        for fault, args in FAULTS[world][name].items():
            record(SpecOptions(out=out / f"{fault}.h5", replay=out / "ref.h5", model=spec, model_args=args))
        if world == 2 and name == "megatron":  # statistics only: the collectives judged by their sums
            record(SpecOptions(out=out / "stats_offset.h5", replay=out / "ref.h5", model=spec, level="stats",
                               model_args={"collective_fault": "offset"}))
    if steps:  # --data-parallel ddp: the Megatron-style model wrapped in DDP all the same
        record(SpecOptions(out=folder / "megatron" / "ddp.h5", model=str(MODEL_FILES / MODELS["megatron"][0]),
                           batch_size=4, data_parallel="ddp"))
        spec = str(MODEL_FILES / "tensor_parallel.py:build_steps")
        record(SpecOptions(out=folder / "steps_ref.h5", model=spec, batch_size=4, steps=3))
        record(SpecOptions(out=folder / "steps_fault.h5", replay=folder / "steps_ref.h5", model=spec,
                           model_args={"wrong_from": 5.0}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), "steps" in sys.argv[2:])
