"""How sensitive the blame is: fault size x precision -> named / missed / wrong module, and clean-run false alarms.

    python bench/sensitivity.py [--dir /tmp/oneiter-sensitivity] [--quick]

Uses the model files of tests/model_files (tiny Hugging Face Llama/GPT-2/BERT/Qwen3-MoE, a U-Net, an MLP-Mixer, a
CNN with functional code in its forward, a token mixer on strided views, an MLP with a vendor optimizer). Each
fault lives *inside the model file* (faultkit, env ONEITER_TEST_FAULT): an instance's wrapped forward, a patched
class, a replaced torch function (forward or backward only), functional code in the root, a kernel wrong only for
strided inputs, an optimizer's option. For every model a float32 CPU reference is recorded once; each target
replays it with one fault of one size in one precision and is compared. A fault is *named* when the verdict's
culprit is the module call (and phase) where the fault lives, *wrong* when another call is named, *missed* when the
verdict is a MATCH (or unattributed). Clean targets (no fault) and benign ones (`BENIGN`: a vendor optimizer in its
own arithmetic) in every precision count *false alarms*. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = HERE.parent / "tests" / "model_files"
sys.path.insert(0, str(FILES))

# (model file, fault, module, call, phase) where the fault lives
FAULTS = [
    ("functional_cnn", "root", "(root)", 0, "forward"),
    ("functional_cnn", "instance:shared@4", "shared", 1, "forward"),
    ("functional_cnn", "instance:head", "head", 0, "forward"),
    ("functional_cnn", "function_bwd:gelu", "shared", 1, "backward"),
    ("hf_llama", "function:silu", "model.layers.0.mlp.act_fn", 0, "forward"),
    ("hf_llama", "function_bwd:silu", "model.layers.1.mlp.act_fn", 0, "backward"),
    ("hf_llama", "function:scaled_dot_product_attention", "model.layers.0.self_attn", 0, "forward"),
    ("hf_llama", "class:LlamaRMSNorm", "model.layers.0.input_layernorm", 0, "forward"),
    ("hf_llama", "instance:model.layers.1.mlp.down_proj", "model.layers.1.mlp.down_proj", 0, "forward"),
    ("hf_gpt2", "function:softmax", "gpt.transformer.h.0.attn", 0, "forward"),
    ("hf_gpt2", "class:GPT2MLP", "gpt.transformer.h.0.mlp", 0, "forward"),
    ("hf_bert", "class:BertIntermediate", "bert.encoder.layer.0.intermediate", 0, "forward"),
    ("unet", "function:interpolate", "(root)", 0, "forward"),
    ("mixer", "class:ChannelMixing", "layers.0.channel_mix", 0, "forward"),
    # fault shapes a rerun must reproduce to see (record/local/fidelity.py): kernels wrong only for strided inputs (a
    # transposed slice with a storage offset; the Mixer's token-mixing fc1), an optimizer option in an instance
    # attribute (its size is ignored: the option is the fault), experts with no float64 kernel (Monte Carlo noise)
    ("strided", "stride:linear", "blocks.0.fc", 0, "forward"),
    ("strided", "stride_bwd:linear", "blocks.1.fc", 0, "backward"),
    ("mixer", "stride:linear", "layers.0.token_mix.fc1", 0, "forward"),
    ("vendor_optim", "optimizer:eps_inside_sqrt", "0", 0, "optimizer"),
    ("hf_moe", "instance:model.layers.0.mlp.experts", "model.layers.0.mlp.experts", 0, "forward"),
]
# benign differences that must stay a MATCH in every precision, counted with the clean runs: a vendor optimizer
# with AdamW's algorithm in its own arithmetic
BENIGN = [("vendor_optim", "optimizer:vendor")]
PRECISIONS = {
    "fp32 (1 thread)": ({"threads": 1}, (1e-5, 1e-4, 1e-3)),
    "bf16 autocast": ({"amp": "bf16"}, (0.005, 0.01, 0.02, 0.05)),
    "fp16 autocast": ({"amp": "fp16"}, (1e-3, 0.005, 0.02)),
    "bf16 model": ({"dtype": "bfloat16"}, (0.01, 0.02, 0.05)),
}


def _pick_faults(quick: bool) -> list:
    """Every fault, or with --quick the first fault of each model file."""
    if not quick:
        return FAULTS
    seen, faults = set(), []
    for fault in FAULTS:
        if fault[0] not in seen:
            seen.add(fault[0])
            faults.append(fault)
    return faults


def _fault_spec(fault: str, size) -> str:
    """faultkit's spec for `fault` at `size`: the size goes after the target, before any `@call`."""
    family, _, rest = fault.partition(":")
    return f"root:{size}" if family == "root" else f"{family}:{rest.split('@')[0]}:{size}" + (
        "@" + rest.split("@")[1] if "@" in rest else "")


def _outcome(v: dict, where: tuple, what: str) -> str:
    """named / missed / wrong for verdict `v` of a fault that lives at `where` (module, call, phase)."""
    culprit = v.get("culprit") or {}
    if v["status"] == "match" or culprit == {}:
        return "missed"
    if (culprit["module"], culprit["call"], culprit["phase"]) == where:
        return "named"
    print(f"  wrong: {what}: {culprit['module']}@{culprit['call']} {culprit['phase']}")
    return "wrong"


def _run_clean(table, label: str, models: list, options: dict, verdict_of) -> None:
    """Count the clean (no fault) and benign targets of every model in one precision: match or false alarm."""
    runs = [(model, "") for model in models] + [(m, spec) for m, spec in BENIGN if m in models]
    for model, spec in runs:
        v = verdict_of(model, spec, options)
        table[(label, "clean")]["false alarm" if v["status"] != "match" else "match"] += 1
        if v["status"] != "match":
            print(f"  false alarm: {model} {spec} {label}: {v.get('basis')} {v.get('module')} {v.get('phase')}")


def _run_faults(table, label: str, sizes: tuple, faults: list, options: dict, verdict_of) -> None:
    """Count every fault at every size in one precision: named, missed or wrong."""
    for size in sizes:
        for model, fault, module, call, phase in faults:
            spec = _fault_spec(fault, size)
            v = verdict_of(model, spec, options)
            table[(label, size)][_outcome(v, (module, call, phase), f"{model} {spec} {label}")] += 1


def _print_table(table) -> None:
    print(f"{'precision':18s} {'fault size':>10s}  named  missed  wrong  | clean: match  false alarm")
    for (label, size), counts in table.items():
        if size == "clean":
            print(f"{label:18s} {'none':>10s}  {'':5s}  {'':6s}  {'':5s}  |        "
                  f"{counts['match']:5d}  {counts['false alarm']:11d}")
        else:
            print(f"{label:18s} {size:>10g}  {counts['named']:5d}  {counts['missed']:6d}  {counts['wrong']:5d}  |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oneiter-sensitivity"))
    parser.add_argument("--quick", action="store_true", help="one fault per model")
    args = parser.parse_args()
    os.environ.setdefault("ONEITER_NO_PROGRESS", "1")
    import faultkit

    from oneiter.judge.iteration.engine import compare_files
    from oneiter.record.run import SpecOptions, record

    args.dir.mkdir(parents=True, exist_ok=True)
    faults = _pick_faults(args.quick)
    models = sorted({f[0] for f in faults})
    refs = {}
    os.environ.pop(faultkit.ENV, None)
    for model in models:
        refs[model] = args.dir / f"{model}_ref.h5"
        record(SpecOptions(out=refs[model], model=f"{FILES / model}.py:build", batch_size=2, force=True))
    tgt = args.dir / "target.h5"

    def verdict_of(model: str, fault: str, options: dict) -> dict:
        os.environ[faultkit.ENV] = fault
        try:
            record(SpecOptions(out=tgt, replay=refs[model], model=f"{FILES / model}.py:build", force=True, **options))
        finally:
            os.environ.pop(faultkit.ENV, None)
            faultkit.undo_faults()
        return compare_files(refs[model], tgt).verdict()

    table = defaultdict(lambda: defaultdict(int))
    started = time.perf_counter()
    for label, (options, sizes) in PRECISIONS.items():
        _run_clean(table, label, models, options, verdict_of)
        _run_faults(table, label, sizes, faults, options, verdict_of)
    print(f"\n{len(faults)} faults in {len(models)} model files; {time.perf_counter() - started:.0f} s\n")
    _print_table(table)


if __name__ == "__main__":
    main()
