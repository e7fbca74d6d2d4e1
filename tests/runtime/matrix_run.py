"""The recordings of the feature matrix (`test_feature_matrix.py`): for each way of running `matrix.py` (one process,
DDP, FSDP2, tensor parallelism) and each feature (`--steps`, `--compile --compile-modules`, `--level stats`, bf16
autocast, activation checkpointing), a clean replay and a replay with a fault in the model's own code.

    python tests/runtime/matrix_run.py DIR one
    python -m torch.distributed.run --nproc-per-node 2 tests/runtime/matrix_run.py DIR ddp fsdp2 tp

One launch records every cell of the runs it is given, each recording by the `oneiter record` command itself (run
in-process: typer's CliRunner; under torchrun inside the launch's process group). Per run: a reference (one
iteration, float32, eager) that every one-iteration cell replays, and a `--steps 4` reference for the steps cell.
Faults (`matrix.py`'s model arguments) scale `blocks.1.up`'s output by 1.05, on rank 1 only under torchrun (rank 0's
replay is then a clean one too), from step 2 on in the steps cell. `DIR/<run>/cells.rank<R>.json` holds per cell its
seconds and, per recording, the command's exit code and its `error:` line ("" when it succeeded).
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

MODEL_FILES = Path(__file__).resolve().parent.parent / "model_files"
sys.path.insert(0, str(MODEL_FILES))

SPEC = str(MODEL_FILES / "matrix.py:build")
PARALLEL = {"one": "", "ddp": "", "fsdp2": "fsdp2", "tp": "tp"}
FAULT_LAYER = "blocks.1.up"
FEATURES = {  # feature -> the replay's flags beyond the reference's
    "compile": ["--compile", "inductor", "--compile-modules", r"blocks\.\d+"],
    "stats": ["--level", "stats"],
    "bf16": ["--amp", "bf16"],
    "checkpointing": ["--model-arg", "checkpointing=non_reentrant"],
}
STEPS, FAULT_FROM = 4, 2


def fault_args(run: str, fault_from: int = 0) -> list[str]:
    rank = -1 if run == "one" else 1
    return ["--model-arg", f"fault={FAULT_LAYER}", "--model-arg", f"fault_rank={rank}",
            "--model-arg", f"fault_from={fault_from}"]


def oneiter_record(folder: Path, out: str, args: list[str]) -> dict:
    """`oneiter record -m matrix.py:build ... -o folder/out`: its exit code and `error:` line."""
    from typer.testing import CliRunner

    from oneiter.cli.main import app

    res = CliRunner().invoke(app, ["record", "-m", SPEC, *args, "-o", str(folder / out), "-q", "--force"])
    error = next((line for line in res.stderr.splitlines() if line.startswith("error:")), "")
    return {"out": out, "code": res.exit_code, "error": error}


def _cell(folder: Path, recordings: list[tuple[str, list[str]]]) -> dict:
    started, runs = time.perf_counter(), []
    for out, args in recordings:
        runs.append(oneiter_record(folder, out, args))
        if runs[-1]["code"]:
            break
    return {"seconds": round(time.perf_counter() - started, 2), "runs": runs}


def record_run(folder: Path, run: str) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    built = ["-b", "4"] + (["--model-arg", f"parallel={PARALLEL[run]}"] if PARALLEL[run] else [])
    ref, steps_ref = ["--replay", str(folder / "ref.h5")], ["--replay", str(folder / "steps_ref.h5")]
    cells = {"reference": _cell(folder, [("ref.h5", built), ("steps_ref.h5", [*built, "--steps", str(STEPS)])]),
             "steps": _cell(folder, [("steps_clean.h5", [*steps_ref, "--seed", "3"]),
                                     ("steps_fault.h5", [*steps_ref, "--seed", "3", *fault_args(run, FAULT_FROM)])])}
    for feature, flags in FEATURES.items():
        cells[feature] = _cell(folder, [(f"{feature}_clean.h5", [*ref, "--seed", "3", *flags]),
                                        (f"{feature}_fault.h5", [*ref, "--seed", "3", *flags, *fault_args(run)])])
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
