"""The Hugging Face Trainer under torchrun (DDP on gloo, 2 ranks) replaying a reference with a fault in one layer, run
again and again: how many runs end with exit 0 on every rank.

    python bench/trainer_torchrun_loop.py --runs 20                  # 20 faulty replays of one reference
    python bench/trainer_torchrun_loop.py --runs 20 --fault ""       # clean replays
    python bench/trainer_torchrun_loop.py --runs 20 --plain          # the same Trainer runs, without oneiter

Each run is one `torchrun --nproc-per-node 2` launch of this file (`--worker`): a tiny random-config Llama
(`tests/model_files/hf_llama.py`) trained 4 steps by the Trainer (plain SGD, `use_cpu=True`: accelerate joins gloo and
wraps the model in DDP), `OneIterCallback(step=2, replay=...)` recording its step 2 with the model file's own fault
(`ONEITER_TEST_FAULT`, default `instance:model.layers.1.mlp.down_proj`). The reference is recorded once, first. Printed:
per run, torchrun's exit code and each rank's (from torchrun's `exitcode` lines; -6 is SIGABRT, what `terminate called
without an active exception` ends with), and at the end the count of runs that ended with 0 everywhere; a failed
run's stderr is kept in the folder (`run<N>.stderr`; `--gdb` runs every rank under gdb for its native stacks).

The abort, found this way (a `std::set_terminate` handler preloaded into the ranks printed the aborting thread's
stack): a gloo worker thread (`ProcessGroupGloo::runLoop`) destroying a finished all-gather (`~AsyncAllgatherWork`:
the Trainer's last collective, `store_flos`'s, right before `train()` returns) whose tensors' Python objects the
caller had already let go, so freeing them takes the GIL (`TensorImpl::decref_pyobject`); the main thread had
begun finalizing by then, CPython ends a thread that takes the GIL then (`pthread_exit`), and that unwinding through
the noexcept run loop calls `std::terminate`. The Trainer never destroys its process group (accelerate's
`end_training` is never called). Measured on 2 cores (load 2-3), before the fix: 47 of 60 plain Trainer runs
(`--plain`, no oneiter) and 53 of 60 faulty replays ended with exit 0; with `OneIterCallback` destroying the group at
exit (`runtime/distributed.py`: `destroy_at_exit`), 40 of 40 replays.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MODEL_FILES = HERE.parent.parent / "tests" / "model_files"
FAULT = "instance:model.layers.1.mlp.down_proj"


def worker(folder: Path, out: str, replay: str | None, seed: int) -> None:
    """One rank of one run: the Trainer's 4 steps, step 2 recorded into `out` (replaying `replay`), or nothing
    recorded (`out` "-": the Trainer alone)."""
    import torch
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(MODEL_FILES))
    import hf_llama

    from oneiter.integrations.hf import OneIterCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int = 16, seq_len: int = 8):
            self.ids = torch.randint(0, 100, (n, seq_len), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(seed)
    model = hf_llama.build(2)[0]
    callbacks = [] if out == "-" else [OneIterCallback(step=2, out=out, replay=replay, force=True)]
    args = TrainingArguments(output_dir=str(folder / "trainer"), max_steps=4, per_device_train_batch_size=2,
                             report_to="none", save_strategy="no", use_cpu=True, seed=seed, dataloader_num_workers=0,
                             optim="sgd", learning_rate=0.05, logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks).train()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(folder: Path, out: str, replay: str | None, fault: str, seed: int,
           gdb: bool = False) -> tuple[int, dict[int, int], str]:
    worker_cmd = [str(HERE), "--worker", "--folder", str(folder), "--out", out if out == "-" else str(folder / out),
                  "--seed", str(seed)]
    if gdb:  # each rank under gdb: a rank that aborts prints every thread's native stack
        worker_cmd = ["--no-python", "gdb", "-q", "-batch", "-ex", "run", "-ex", "thread apply all bt", "--args",
                      sys.executable, *worker_cmd]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), *worker_cmd]
    if replay:
        cmd += ["--replay", str(folder / replay)]
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1", "ONEITER_TEST_FAULT": fault}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # torchrun names each failed rank: "rank      : 1 (local_rank: 1)" then "exitcode  : -6 (pid: ...)"
    ranks = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", proc.stderr)}
    return proc.returncode, ranks, proc.stderr + (proc.stdout if gdb else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--fault", default=FAULT, help="ONEITER_TEST_FAULT of the replays ('' for clean ones)")
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--plain", action="store_true", help="the same Trainer runs without oneiter's callback")
    parser.add_argument("--gdb", action="store_true", help="every rank under gdb (native stacks of an abort)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.folder, args.out, args.replay, args.seed)
        return
    folder = args.folder or Path(tempfile.mkdtemp(prefix="trainer_loop_"))
    folder.mkdir(parents=True, exist_ok=True)
    code, ranks, err = launch(folder, "ref.h5", None, "", 0, gdb=args.gdb)
    if code != 0:
        (folder / "ref.stderr").write_text(err)
        sys.exit(f"the reference failed (exit {code}, its stderr in {folder / 'ref.stderr'}):\n{err[-3000:]}")
    print(f"load average {os.getloadavg()[0]:.1f}; reference {folder / 'ref.rank0.h5'}, .rank1.h5; "
          f"{'no callback' if args.plain else f'fault {args.fault!r}'}")
    clean = 0
    for run in range(args.runs):
        started = time.perf_counter()
        code, ranks, err = launch(folder, "-" if args.plain else "tgt.h5", None if args.plain else "ref.h5",
                                  args.fault, 3, gdb=args.gdb)
        clean += code == 0
        aborted = "terminate called" in err
        if code != 0 or aborted:
            (folder / f"run{run + 1}.stderr").write_text(err)
        print(f"run {run + 1:2d}: torchrun exit {code}, failed ranks {ranks or '-'}"
              f"{', terminate called' if aborted else ''} ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{clean} of {args.runs} runs ended with exit 0 on every rank (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
