"""What activation checkpointing and FSDP2 cost a recording: a plain iteration, a record and an isolated replay,
seconds and peak RSS, with checkpointing off, non-reentrant and reentrant, and on two ranks under FSDP2.

    python bench/bench_large_training.py                         # everything (~25 min on 2 shared cores)
    python bench/bench_large_training.py --only hf --repeat 5    # the tiny Hugging Face Llama only
    python bench/bench_large_training.py --only llama --only fsdp --repeat 1

Models: the tiny random-config Hugging Face Llama of the tests (`tests/model_files/hf_llama.py`, batch 2, its
`checkpointing` switch: `gradient_checkpointing_enable`), and the 118 M-parameter built-in `llama_tiny` (dim 1024,
8 layers, vocabulary 8192, 16 heads, batch 4) through this file's `build`, which checkpoints each block's forward
(`torch.utils.checkpoint`, hooks outside as Hugging Face does) and, under torchrun with `shard=1`, applies FSDP2's
`fully_shard` to every block and the root (torchtitan's way).

Each step runs in a fresh process (`--repeat` of them; the median is shown with the range): `import torch` and the
model's build are outside the clock, one forward and backward run before it (warm kernels, as a job recorded at
step N is). `plain` is the median of warm training iterations (forward, loss, backward, SGD step; at least 5 and
2 s of them, at most 30); `record` one
recorded iteration, its file written and renamed; `replay` one `record --replay` of that reference with the
per-call isolation (teacher-forced reruns and calibration), the default. `CPU s` is the process's CPU time over
the same span (every thread: torch's, the background writer's; the median of the runs): less at the mercy of
other processes on the cores than wall seconds. Peak RSS is the process's VmHWM. The
FSDP2 rows are two ranks under `torchrun --nproc-per-node 2` (gloo): per rank, the same three steps, each launch
a fresh pair of processes. Every process runs torch with `--threads` intra-op threads (default 1: with two on two
cores that other processes share, OpenMP's threads spin-wait for each other, and the tiny model's 10 ms iteration
was measured at 0.8 s). The machine's load average is printed before and after each table: these cores are
shared, and a figure is only as good as what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
LLAMA_118M = {"dim": 1024, "num_layers": 8, "vocab_size": 8192, "num_heads": 16}
HF = f"{ROOT / 'tests' / 'model_files' / 'hf_llama.py'}:build"
LLAMA = f"{HERE}:build"
MODES = ("", "non_reentrant", "reentrant")


def build(batch_size, checkpointing="", shard=0, **llama_args):
    """The built-in llama_tiny, each block's forward checkpointed (`checkpointing`), FSDP2-sharded under torchrun
    (`shard=1`: every block, then the root)."""
    import functools

    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from oneiter.models.llama import llama_tiny

    model, inputs, loss_fn = llama_tiny(batch_size, **llama_args)
    if checkpointing:
        for layer in model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=checkpointing == "reentrant")
    if int(shard) and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, inputs, loss_fn


STEP = """
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import torch, torch.distributed as dist
torch.set_num_threads({threads})
from oneiter.record.capture import hooks as capture
from oneiter.record.local import probe, rerun
from oneiter.record.modes import randomness
from oneiter.record import session  # imported before the clock starts
from oneiter.record.recorder import Recorder
from oneiter.runtime.training import train_step
if {distributed!r}:
    dist.init_process_group("gloo")
from record_loop import prepared
setup = prepared({spec!r}, {batch}, {args!r})
if {step!r} == "plain":  # at least 5 iterations and 2 s of them (at most 30): a tiny model's 10 ms iteration
    times, cpus = [], []  # is at the mercy of the scheduler on shared cores
    while len(times) < 30 and (len(times) < 5 or sum(times) < 2.0):
        c0, t0 = time.process_time(), time.perf_counter()
        train_step(setup)
        times.append(time.perf_counter() - t0); cpus.append(time.process_time() - c0)
    seconds, cpu = statistics.median(times), statistics.median(cpus)
else:
    replay, inputs = {replay!r}, setup.inputs
    os.sync()
    c0, t0 = time.process_time(), time.perf_counter()
    with Recorder(setup.bundle.model, Path({out!r}), optimizer=setup.optimizer, force=True,
                  replay=Path(replay) if replay else None) as rec:
        batch = rec.inputs(*setup.inputs)
        setup.inputs = batch if len(inputs) != 1 else (batch,)
        train_step(setup)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
rank = dist.get_rank() if dist.is_initialized() else 0
print("RESULT " + json.dumps({{"rank": rank, "seconds": seconds, "cpu": cpu, "rss_mb": rss / 1024}}))
if dist.is_initialized():
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


THREADS = 1  # --threads: torch's intra-op threads in every step


def run_step(step: str, spec: str, batch: int, args: dict, out: Path, replay: Path | None = None,
             ranks: int = 1) -> dict[int, dict]:
    """One step in fresh process(es): rank -> {seconds, cpu, rss_mb}."""
    code = STEP.format(bench=str(HERE.parent), distributed=ranks > 1, spec=spec, batch=batch, args=args, step=step,
                       out=str(out), replay=str(replay) if replay else None, threads=THREADS)
    if step != "plain":
        for path in out.parent.glob(f"{out.stem}*.h5"):
            path.unlink()
    os.sync()
    env = {**os.environ, "ONEITER_NO_PROGRESS": "1", "PYTHONWARNINGS": "ignore"}
    if ranks > 1:
        script = out.with_suffix(".step.py")
        script.write_text(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), str(script)]
    else:
        cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"benchmark step {step} of {spec} failed:\n{proc.stderr[-4000:]}")
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {r["rank"]: r for r in found}


def measure(repeat: int, *step_args, **step_kwargs) -> dict[int, dict]:
    """`run_step` `repeat` times: per rank the median seconds with (min, max), and the largest peak RSS."""
    runs = [run_step(*step_args, **step_kwargs) for _ in range(repeat)]
    result = {}
    for rank in runs[0]:
        seconds = sorted(r[rank]["seconds"] for r in runs)
        result[rank] = {"seconds": statistics.median(seconds), "spread": (seconds[0], seconds[-1]),
                        "cpu": statistics.median(r[rank]["cpu"] for r in runs),
                        "rss_mb": max(r[rank]["rss_mb"] for r in runs)}
    return result


def _load() -> str:
    one, five, _fifteen = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def _fmt(r: dict, plain: float) -> str:
    low, high = r["spread"]
    return f"{r['seconds']:.3f} [{low:.3f}-{high:.3f}] {r['seconds'] / plain:.1f}x"


def _cpu(r: dict, plain: dict) -> str:
    return f"{r['cpu']:.3f} {r['cpu'] / plain['cpu']:.1f}x"


def table(title: str, spec: str, batch: int, base_args: dict, work: Path, repeat: int, *, ranks: int = 1,
          modes=MODES) -> None:
    print(f"\n{title} (batch {batch}; {_load()})")
    print(f"  {'checkpointing':<14} {'rank':>4}  {'plain s':>26}  {'record s (x plain)':>28}  "
          f"{'replay s (x plain)':>28}  {'CPU s plain / record / replay':>34}  {'peak RSS plain/record/replay':>30}")
    for mode in modes:
        args = {**base_args, "checkpointing": mode} if mode or "checkpointing" in base_args else dict(base_args)
        ref, tgt = work / "ref.h5", work / "tgt.h5"
        plain = measure(repeat, "plain", spec, batch, args, work / "plain.h5", ranks=ranks)
        rec = measure(repeat, "record", spec, batch, args, ref, ranks=ranks)
        run_step("record", spec, batch, args, ref, ranks=ranks)  # the reference the replays read
        rep = measure(repeat, "replay", spec, batch, args, tgt, replay=ref, ranks=ranks)
        for rank in sorted(plain):
            p = plain[rank]["seconds"]
            low, high = plain[rank]["spread"]
            rss = f"{plain[rank]['rss_mb']:,.0f}/{rec[rank]['rss_mb']:,.0f}/{rep[rank]['rss_mb']:,.0f} MB"
            cpu = f"{plain[rank]['cpu']:.3f} / {_cpu(rec[rank], plain[rank])} / {_cpu(rep[rank], plain[rank])}"
            print(f"  {mode or 'off':<14} {rank:>4}  {p:>10.3f} [{low:.3f}-{high:.3f}]  {_fmt(rec[rank], p):>28}  "
                  f"{_fmt(rep[rank], p):>28}  {cpu:>34}  {rss:>30}")
    print(f"  ({_load()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=("hf", "llama", "fsdp"),
                        help="the tables to run (default: all three)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per step (the median is shown)")
    parser.add_argument("--dir", default="/tmp/oneiter-bench-large")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (default 1: on "
                        "shared cores two OpenMP threads spin-wait for each other whenever another process holds one)")
    parser.add_argument("--fsdp-args", default=json.dumps(LLAMA_118M),
                        help="llama_tiny model_args of the FSDP2 model (JSON; default the 118 M one)")
    args = parser.parse_args()
    global THREADS
    THREADS = max(1, args.threads)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ("hf", "llama", "fsdp"))
    repeat = max(1, args.repeat)
    print(f"files in {work}; {repeat} fresh process(es) per step, median [min-max]; {THREADS} torch thread(s)")
    if "hf" in only:
        table("tiny Hugging Face Llama (tests/model_files/hf_llama.py)", HF, 2, {}, work, repeat)
    if "llama" in only:
        table("llama_tiny 118 M (dim 1024, 8 layers)", LLAMA, 4, LLAMA_118M, work, repeat)
    if "fsdp" in only:
        table("llama_tiny under FSDP2, 2 ranks (torchrun, gloo)", LLAMA, 4, {**json.loads(args.fsdp_args), "shard": 1},
              work, repeat, ranks=2, modes=("", "non_reentrant"))


if __name__ == "__main__":
    main()
