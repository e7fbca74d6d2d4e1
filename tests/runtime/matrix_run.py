"""The recordings of the feature matrix (`test_feature_matrix.py`): for each way of running `matrix.py` (one process,
DDP, FSDP2, tensor parallelism) and each feature (`--steps`, `--compile --compile-modules`, `--level stats`, bf16
autocast, activation checkpointing), a clean replay and a replay with a fault in the model's own code.

    python tests/runtime/matrix_run.py DIR one
    python -m torch.distributed.run --nproc-per-node 2 tests/runtime/matrix_run.py DIR ddp fsdp2 tp

One launch records every cell of the runs it is given, through the CLI's path (`oneiter.record.run.record`): per run a
reference (one iteration, float32, eager) that every one-iteration cell replays, and a `--steps 4` reference for the
steps cell. Faults (`matrix.py`'s model arguments) hit `blocks.1.up`'s output, +5 %, on rank 1 only under torchrun
(rank 0's replay is then clean too), from step 2 on for the steps cell. A cell that oneiter refuses records its one
line. `DIR/<run>/cells.rank<R>.json` holds per cell its seconds and, if refused, the error.
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

MODEL_FILES = Path(__file__).resolve().parent.parent / "model_files"
sys.path.insert(0, str(MODEL_FILES))

from oneiter.errors import OneIterError  # noqa: E402
from oneiter.record.run import SpecOptions, record  # noqa: E402

SPEC = str(MODEL_FILES / "matrix.py:build")
PARALLEL = {"one": "", "ddp": "", "fsdp2": "fsdp2", "tp": "tp"}
FAULT_LAYER = "blocks.1.up"
FEATURES = {  # feature -> the replay's options beyond the reference's
    "compile": {"compile": "inductor", "compile_modules": [r"blocks\.\d+"]},
    "stats": {"level": "stats"},
    "bf16": {"amp": "bf16"},
    "checkpointing": {"model_args": {"checkpointing": "non_reentrant"}},
}
STEPS, FAULT_FROM = 4, 2


def _fault(run: str, fault_from: int = 0) -> dict:
    return {"fault": FAULT_LAYER, "fault_rank": -1 if run == "one" else 1, "fault_from": fault_from}


def _cell(folder: Path, name: str, recordings: list[tuple[str, dict]], cells: dict) -> None:
    """Record `recordings` ((file name, SpecOptions keywords) each) as the cell `name`: its seconds, or its error."""
    started = time.perf_counter()
    try:
        for out, options in recordings:
            record(SpecOptions(out=folder / out, model=SPEC, **options))
    except OneIterError as err:
        cells[name] = {"seconds": time.perf_counter() - started, "refused": str(err)}
        return
    cells[name] = {"seconds": time.perf_counter() - started}


def record_run(folder: Path, run: str) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    args = {"parallel": PARALLEL[run]}
    cells: dict = {}
    _cell(folder, "reference", [("ref.h5", {"batch_size": 4, "model_args": args}),
                                ("steps_ref.h5", {"batch_size": 4, "model_args": args, "steps": STEPS})], cells)
    _cell(folder, "steps", [("steps_clean.h5", {"replay": folder / "steps_ref.h5", "seed": 3}),
                            ("steps_fault.h5", {"replay": folder / "steps_ref.h5", "seed": 3,
                                                "model_args": _fault(run, FAULT_FROM)})], cells)
    for feature, options in FEATURES.items():
        extra = options.get("model_args", {})
        clean = {**options, "replay": folder / "ref.h5", "seed": 3}
        fault = {**clean, "model_args": {**extra, **_fault(run)}}
        _cell(folder, feature, [(f"{feature}_clean.h5", clean), (f"{feature}_fault.h5", fault)], cells)
    rank = dist.get_rank() if dist.is_initialized() else 0
    (folder / f"cells.rank{rank}.json").write_text(json.dumps(cells, indent=1))
    return cells


def main(folder: Path, runs: list[str]) -> None:
    distributed = runs != ["one"]
    if distributed:
        dist.init_process_group("gloo")
    for run in runs:
        record_run(folder / run, run)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
