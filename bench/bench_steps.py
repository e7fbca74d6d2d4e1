"""Multi-step recordings (`record --steps`): how the band was validated, and what a recorded step costs.

    nice -n 10 python bench/bench_steps.py band                  # clean and faulty replays, error against the twin
    nice -n 10 python bench/bench_steps.py band --steps 30 --only hf
    nice -n 10 python bench/bench_steps.py cost                  # resnet18 b8 and the 118 M llama_tiny, 100 steps
    nice -n 10 python bench/bench_steps.py cost --steps 20 --only llama

`band`: for each model (the tiny Hugging Face Llama of the tests, the built-in `llama_tiny` at sequence length 16
and `resnet18` at 32x32 and batch 8, each with a new batch per step), each optimizer (SGD with momentum, AdamW) and
each target — float32 on another thread count (other reduction orders: not bitwise where the model is large enough
to split its reductions), bf16 and fp16 autocast, bfloat16 weights — a reference of `--steps` iterations is recorded
(2 threads), then replayed by the target (with its twin), and for every step and each group of the signature
(`format/signature.py`: gradients, updates) the ratio error / (band / `BAND_FACTOR`) is printed: a clean run is flagged
only where it exceeds `BAND_FACTOR`. The largest ratio of each clean run is what `BAND_FACTOR` must stay above. Then
faults that start at step `--fault-at` (a layer's output scaled by 1 + REL from that step on, in the target's code,
so its twin runs it too: in every precision, or only where the layer computes in bfloat16/float16, a kernel wrong in
the lower precision alone) show the ratio at that step, and the first step the verdict names with the factor in
force: how large a fault the band still sees in each precision.

`cost`: the plain training step against `record --steps N` (the reference: statistics of every tensor per step),
its replay (each step also run by the twin) and the file size (the first step's, which holds the start in full,
and each later step's, mostly its batch), for resnet18 at batch 8 (224x224) and the 118 M `llama_tiny` (dim 1024,
8 layers, vocabulary 8192, batch 4). Each in a fresh process; plain is the median of warm steps before the
recording, in the same process; record and replay are their wall time over the steps (the first step, which
writes the start in full, and opening the files included). The machine's load average is
printed: these cores are shared with other jobs, so figures are what they were then.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "model_files"))
HF = f"{ROOT / 'tests' / 'model_files' / 'hf_llama.py'}:build_steps"
SPEC = f"{HERE}:build"
LLAMA_118M = {"dim": 1024, "num_layers": 8, "vocab_size": 8192, "num_heads": 16}
SMALL = {"resnet18": {"image_size": 32, "num_classes": 10}, "llama_tiny": {"seq_len": 16}, "hf": {}}
BATCH = {"resnet18": 8, "llama_tiny": 2, "hf": 2}  # BatchNorm over 2 samples of one batch is no training: 8
FAULT_LAYER = {"resnet18": "fc", "llama_tiny": "layers.1.feed_forward.w2",
               "hf": "model.layers.1.mlp.down_proj"}

_STEP = {"now": 0}


def build(batch_size, model="resnet18", fault_at=-1, rel=0.0, lowp=False, **args):
    """A model of the contract with `batch(step)`: the built-in `model` (the same batch every step) or the tests'
    Hugging Face Llama ("hf"); from step `fault_at` on (>= 0), the output of `FAULT_LAYER[model]` is scaled by
    1 + `rel` (the target's code: its twin runs it too)."""
    if model == "hf":
        import hf_llama

        net, inputs, loss_fn, _, step_batch = hf_llama.build_steps(batch_size, **args)
    else:
        import torch

        from oneiter import models

        builder = models.get_builder(model)
        net, inputs, loss_fn = builder(batch_size, **args)

        def step_batch(step):
            """A new batch each step: the builder's own (images and labels, or tokens), drawn with seed 1000 + step
            (the model it builds again is thrown away); the global RNG is left as it was."""
            with torch.random.fork_rng():
                torch.manual_seed(1000 + step)
                _, new_inputs, new_loss = builder(batch_size, **args)
            return new_inputs, new_loss

    if int(fault_at) >= 0:
        import torch

        scale = 1.0 + float(rel)

        def hook(module, args, output):
            wrong = _STEP["now"] >= int(fault_at) and (not lowp or output.dtype in (torch.bfloat16, torch.float16))
            return output * scale if wrong else output

        net.get_submodule(FAULT_LAYER[model]).register_forward_hook(hook)

    def batch(step):
        _STEP["now"] = step
        return step_batch(step)

    return net, inputs, loss_fn, None, batch


# -- band -----------------------------------------------------------------------------------------------------------
TARGETS = {"fp32-1thread": {"threads": 1}, "bf16": {"amp": "bf16"}, "fp16": {"amp": "fp16"},
           "bf16-weights": {"dtype": "bfloat16"}}


def _record(out: Path, **kwargs):
    from oneiter.record.run import SpecOptions, record

    return record(SpecOptions(out=out, force=True, **kwargs))


def _ratios(ref: Path, tgt: Path) -> dict:
    """Per group: error / (band / BAND_FACTOR) per step where the group is judged (NaN where not: its band exceeds
    DECORRELATED), the verdict's status and step, and the first step not judged at all."""
    import math

    import oneiter
    from oneiter.judge.stepwise.step_compare import BAND_FACTOR

    result = oneiter.compare(ref, tgt)
    out = {"step": result.step, "status": result.status, "bitwise": sum(r.bitwise for r in result.rows),
           "unjudged": next((r.step for r in result.rows if not r.judged), None)}
    for group in ("gradients", "updates"):
        out[group] = [0.0 if r.bitwise else math.nan if not r.judges(group) else
                      r.errors[group] / (r.bands[group] / BAND_FACTOR) if r.bands[group] else math.inf
                      for r in result.rows]
    return out


def _worst(values: list) -> float:
    finite = [v for v in values if v == v]
    return max(finite) if finite else float("nan")


def band(args) -> None:
    from oneiter.judge.stepwise.step_compare import BAND_FACTOR

    folder = Path(tempfile.mkdtemp(prefix="bench_steps_"))
    print(f"load average {os.getloadavg()}; {args.steps} steps; BAND_FACTOR {BAND_FACTOR}")
    summary = []
    for model in args.only or list(SMALL):
        model_args = {"model": model, **SMALL[model]}
        for optimizer in ("sgd", "adamw"):
            ref = folder / f"{model}-{optimizer}.h5"
            _record(ref, model=SPEC, steps=args.steps, optimizer=optimizer, batch_size=BATCH[model],
                    model_args=model_args, threads=2)
            for name, target in TARGETS.items():
                tgt = folder / f"{model}-{optimizer}-{name}.h5"
                _record(tgt, model=SPEC, replay=ref, **{"threads": 2, **target})
                found = _ratios(ref, tgt)
                worst = {g: _worst(found[g]) for g in ("gradients", "updates")}
                summary.append((model, optimizer, name, worst, found["step"], found["bitwise"]))
                print(f"clean {model:10} {optimizer:5} {name:13} largest error/drift where judged: gradients "
                      f"{worst['gradients']:7.3f}  updates {worst['updates']:7.3f}  {found['status']:12} flagged step "
                      f"{found['step']}  not judged from step {found['unjudged']}  bitwise steps {found['bitwise']}",
                      flush=True)
            for name, lowp in (("fp32-1thread", False), ("bf16", False), ("bf16", True), ("bf16-weights", True)):
                for rel in args.rel:
                    tgt = folder / f"{model}-{optimizer}-{name}-fault.h5"
                    fault = {**model_args, "fault_at": args.fault_at, "rel": rel, "lowp": lowp}
                    _record(tgt, model=SPEC, replay=ref, model_args=fault, **{"threads": 2, **TARGETS[name]})
                    found = _ratios(ref, tgt)
                    at = {g: found[g][args.fault_at] for g in ("gradients", "updates")}
                    kind = "low precision only" if lowp else "every precision"
                    print(f"fault {model:10} {optimizer:5} {name:13} {kind:18} rel {rel:7.0e} at step {args.fault_at}: "
                          f"error/drift gradients {at['gradients']:9.3f} updates {at['updates']:9.3f}  "
                          f"{found['status']:12} flagged step {found['step']}  not judged from step "
                          f"{found['unjudged']}", flush=True)
    clean = [w for *_, w, _s, _b in summary]
    print(f"largest clean error/drift over every run: gradients {_worst([w['gradients'] for w in clean]):.3f}, "
          f"updates {_worst([w['updates'] for w in clean]):.3f} (BAND_FACTOR {BAND_FACTOR}); "
          f"clean runs flagged: {sum(s is not None for *_, s, _b in summary)} of {len(summary)}")
    print(f"load average {os.getloadavg()}")


# -- cost -----------------------------------------------------------------------------------------------------------
COST = {"resnet18": ("resnet18", 8, {}), "llama": ("llama_tiny", 4, LLAMA_118M)}
CHILD = """
import json, statistics, sys, time
from pathlib import Path
import torch
torch.set_num_threads({threads})
from oneiter.record.run import SpecOptions, record
from oneiter.runtime.modelspec import load_model
from oneiter.runtime.training import prepare, train_step
bundle = load_model({model!r}, {batch}, 0, {args!r})
setup = prepare(bundle, torch.device("cpu"), "sgd")
train_step(setup)
times = []
for _ in range({plain}):
    t = time.perf_counter(); train_step(setup); times.append(time.perf_counter() - t)
t = time.perf_counter()
record(SpecOptions(out=Path({out!r}), model={model!r}, batch_size={batch}, model_args={args!r}, steps={steps},
                   threads={threads}))
ref_s = time.perf_counter() - t
t = time.perf_counter()
record(SpecOptions(out=Path({out!r} + ".tgt.h5"), replay=Path({out!r}), model={model!r}, threads={threads}))
tgt_s = time.perf_counter() - t
record(SpecOptions(out=Path({out!r} + ".one.h5"), model={model!r}, batch_size={batch}, model_args={args!r}, steps=1,
                   threads={threads}))
print(json.dumps({{"plain": statistics.median(times), "record": ref_s / {steps}, "replay": tgt_s / {steps},
                   "bytes": Path({out!r}).stat().st_size, "bytes_replay": Path({out!r} + ".tgt.h5").stat().st_size,
                   "bytes_one": Path({out!r} + ".one.h5").stat().st_size}}))
"""


def cost(args) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench_steps_cost_"))
    print(f"load average {os.getloadavg()}; {args.steps} steps; {args.threads} thread(s)")
    for name in args.only or list(COST):
        model, batch, model_args = COST[name]
        out = folder / f"{name}.h5"
        code = CHILD.format(threads=args.threads, model=model, batch=batch, args=model_args, plain=args.plain,
                            out=str(out), steps=args.steps)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-2000:])
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:9} batch {batch}: plain {found['plain']:.3f} s/step; --steps {args.steps}: record "
              f"{found['record']:.3f} s/step ({found['record'] / found['plain']:.2f}x), replay with twin "
              f"{found['replay']:.3f} s/step ({found['replay'] / found['plain']:.2f}x); file "
              f"{found['bytes'] / 1e6:.1f} MB (the first step {found['bytes_one'] / 1e6:.1f} MB: its weights, "
              f"buffers and optimizer state in full; each later step "
              f"{(found['bytes'] - found['bytes_one']) / 1e3 / max(args.steps - 1, 1):.0f} KB), replay's "
              f"{found['bytes_replay'] / 1e6:.1f} MB; {time.perf_counter() - started:.0f} s in all", flush=True)
        for path in folder.glob(f"{name}.h5*"):
            path.unlink()
    print(f"load average {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("band")
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--fault-at", type=int, default=6)
    b.add_argument("--rel", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1])
    b.add_argument("--only", action="append", choices=list(SMALL))
    c = sub.add_parser("cost")
    c.add_argument("--steps", type=int, default=100)
    c.add_argument("--plain", type=int, default=5)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--only", action="append", choices=list(COST))
    args = parser.parse_args()
    (band if args.what == "band" else cost)(args)


if __name__ == "__main__":
    main()
