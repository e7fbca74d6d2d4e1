"""What isolation costs: `record --replay` seconds with and without the per-call local reruns (and calibration).

    python bench/bench_isolation.py [--repeat 3] [--dir /tmp/oneiter-bench-iso] [--amp bf16] [--threads N]
    python bench/bench_isolation.py --fidelity-ab [--threads 1]    # what the fidelity check costs

For resnet18 (batch 8, 224x224) and a small Hugging Face Llama (transformers, random config: hidden 128,
4 layers, 4 heads, sequence 64, batch 8), each in its own fresh process (`import torch` excluded from timings):
record a float32 reference, then replay it `--repeat` times without isolation (`isolate=False`) and with it
(the default), and print the median seconds of the whole `record()` call, the ratio, and the replay file size.
`--amp bf16` replays under bf16 autocast (every call then needs calibration); the default float32 replay on
the same device is exact and mostly needs none. Only `RecordOptions(out, model, replay, isolate, amp)` is used,
so the script also runs against older oneiter versions (PYTHONPATH=<old checkout>) for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

HF_LLAMA = textwrap.dedent('''
    """A small transformers Llama from a random config (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM


    def build(batch_size, seq_len=64):
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=512, max_position_embeddings=seq_len,
                             attn_implementation="sdpa", use_cache=False)
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))

        def loss_fn(out):
            logits = out.logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1).to(logits.device))

        return model, (ids,), loss_fn
''')

RECORD = """
import json, time
from pathlib import Path
import torch
try:
    from oneiter.record.run import SpecOptions as RecordOptions, record
except ImportError:  # an older checkout (before/after figures)
    try:
        from oneiter.record.run import RecordOptions, record
    except ImportError:
        from oneiter.recorders.record import RecordOptions, record
kwargs = {kwargs}
if {no_check}:  # the fidelity check off (record/local/fidelity.py): the A/B of what it costs
    from oneiter.record.local.probe import TeacherForcedProbe
    TeacherForcedProbe.CHECKS_LIVE = False
t0 = time.perf_counter()
s = record(RecordOptions(out=Path({out!r}), force=True, **kwargs))
print(json.dumps({{"seconds": time.perf_counter() - t0, "file_bytes": s.file_bytes}}))
"""


def run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(name: str, model: str, batch: int, folder: Path, repeat: int, amp, fidelity_ab: bool = False,
          model_args: dict | None = None, threads: dict | None = None) -> dict:
    ref = folder / f"{name}_ref.h5"
    run(RECORD.format(out=str(ref), kwargs=repr({"model": model, "batch_size": batch, **(model_args or {})}),
                      no_check=False))
    found = {}
    variants = {"plain": (False, False), "isolated": (True, False)}
    if fidelity_ab:  # isolated with the fidelity check (the default) and without it
        variants = {"unchecked": (True, True), "isolated": (True, False)}
    for label, (isolate, no_check) in variants.items():
        extra = {"replay": ref, "model": model, "isolate": isolate, **({"amp": amp} if amp else {}),
                 **(threads or {})}
        code = RECORD.format(out=str(folder / f"{name}_tgt.h5"), kwargs=repr(extra), no_check=no_check).replace(
            "PosixPath(", "Path(")
        runs = [run(code) for _ in range(repeat)]
        found[label] = {
            "seconds": statistics.median(r["seconds"] for r in runs), "all": [round(r["seconds"], 2) for r in runs],
            "file_bytes": runs[-1]["file_bytes"]}
    base = found["unchecked" if fidelity_ab else "plain"]
    found["ratio"] = found["isolated"]["seconds"] / base["seconds"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oneiter-bench-iso"))
    parser.add_argument("--amp", default=None)
    parser.add_argument("--only", default=None, help="resnet18, hf_llama or llama_118m")
    parser.add_argument("--fidelity-ab", action="store_true",
                        help="isolated replays with the fidelity check (default) vs without it, instead of isolation "
                             "on/off; adds the 118 M llama_tiny (dim 1024, 8 layers, batch 2)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the target's thread count (another reduction order: every value downstream of the first "
                             "differing one is inexact, so the check reruns those calls on the live values)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    llama = args.dir / "hf_llama_bench.py"
    llama.write_text(HF_LLAMA)
    cases = {"resnet18": ("resnet18", 8, None), "hf_llama": (f"{llama}:build", 8, None)}
    if args.fidelity_ab:
        cases["llama_118m"] = ("llama_tiny", 2, {"model_args": {"dim": 1024, "num_layers": 8, "vocab_size": 8192,
                                                                   "num_heads": 16}})
    results = {}
    threads = {"threads": args.threads} if args.threads else None
    for name, (model, batch, model_args) in cases.items():
        if args.only and name != args.only:
            continue
        results[name] = r = bench(name, model, batch, args.dir, args.repeat, args.amp, args.fidelity_ab, model_args,
                                  threads)
        base = "unchecked" if args.fidelity_ab else "plain"
        print(f"{name:10s} replay {'without the fidelity check' if args.fidelity_ab else 'without isolation'} "
              f"{r[base]['seconds']:6.2f} s {r[base]['all']}, with {r['isolated']['seconds']:6.2f} s "
              f"{r['isolated']['all']} ({r['ratio']:.2f}x); files {r[base]['file_bytes'] / 1e6:.0f} / "
              f"{r['isolated']['file_bytes'] / 1e6:.0f} MB", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
