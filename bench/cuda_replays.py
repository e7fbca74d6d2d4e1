"""What only a GPU shows: CUDA records against themselves, CPU -> CUDA replays with TF32 off and on, `--calibrate cpu`
and `device`, and an injected fault, on the three built-in models at small sizes.

    python bench/cuda_replays.py invariance   # two CUDA records of one seed compared; a CUDA self-replay
    python bench/cuda_replays.py replays      # clean CPU reference -> CUDA replays: TF32 off/on x calibrate cpu/device
    python bench/cuda_replays.py faults       # the same replays with a 5 % fault in one deep layer
    python bench/cuda_replays.py steps        # 12 steps of the tests' HF Llama: CUDA against CUDA, CPU -> CUDA
                                              # replays (TF32 off/on, bf16) and two faults first hit at step 6

Each line printed is one comparison (JSON: status, the entry the verdict names, counts, headline); all of them also
land in $OUT/<what>.json when OUT is set (else /tmp/cuda_replays/). "TF32 off" sets
`torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32` to False in the recording process,
"on" both to True (torch's own default is cuDNN on, cuBLAS off). Needs a CUDA machine; nothing here runs in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

WORK = "/tmp/cuda_replays"
DEVICE = os.environ.get("ONEITER_BENCH_DEVICE", "cuda")  # "cpu": a dry run of this script on a machine without one
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_STEPS = ["--model", f"{ROOT}/tests/model_files/hf_llama.py:build_steps", "--model-arg", "layers=1"]
MODELS = {"resnet18": ["--model-arg", "image_size=64"], "mobilenet_v2": ["--model-arg", "image_size=64"],
          "llama_tiny": ["--model-arg", "seq_len=64"]}
FAULT = {"resnet18": "layer3.1.conv2", "mobilenet_v2": "features.10.conv.1.0", "llama_tiny": "layers.1.feed_forward.w2"}


def cli_with_tf32() -> None:
    """`python cuda_replays.py --cli ARGS`: oneiter's CLI with TF32 set from ONEITER_TF32 (0 or 1) first."""
    import torch

    tf32 = os.environ.get("ONEITER_TF32")
    if tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32 == "1"
    from oneiter.cli.main import main

    sys.argv = ["oneiter", *sys.argv[2:]]
    main()


def oneiter(args: list[str], tf32: int | None = None, fault: str = "") -> tuple[int, str]:
    env = dict(os.environ, ONEITER_NO_PROGRESS="1", ONEITER_TEST_FAULT=fault)  # the model files' faults (faultkit)
    if tf32 is not None:
        env["ONEITER_TF32"] = str(tf32)
    done = subprocess.run([sys.executable, __file__, "--cli", *args], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout + done.stderr


def record(args: list[str], tf32: int | None = None, fault: str = "") -> None:
    started = time.perf_counter()
    code, output = oneiter(["record", *args, "--force"], tf32, fault)
    print(f"record {' '.join(args)}: exit {code} in {time.perf_counter() - started:.1f} s", flush=True)
    if code:
        print(output[-2000:], flush=True)


def _report(reference: str, target: str, tag: str) -> tuple[int, dict | None, str]:
    """`oneiter compare --json`: its exit code, its document (None when it wrote none) and its output."""
    report = f"{WORK}/{tag}.json"
    code, output = oneiter(["compare", reference, target, "--json", report])
    try:
        return code, json.load(open(report)), output
    except (OSError, ValueError):
        return code, None, output


def compare(reference: str, target: str, tag: str) -> dict:
    code, doc, output = _report(reference, target, tag)
    if doc is None:
        return {"tag": tag, "exit": code, "error": output[-1500:]}
    v, rows = doc["verdict"], doc["rows"]
    return {"tag": tag, "exit": code, "status": v["status"], "focus": v.get("focus"),
            "entry": None if v.get("module") is None else f"{v['module']}@{v['call']} {v['phase']} {v['tensor']}",
            "entries": len(rows), "bitwise_rows": sum(1 for r in rows if r.get("max_abs") == 0),
            "flagged": v.get("num_flagged"), "headline": v.get("headline")}


def invariance(model: str, base: list[str]) -> list[dict]:
    a, b, c = (f"{WORK}/{model}.cuda.{x}.h5" for x in "abc")
    record([*base, "--device", "cuda", "-o", a])
    record([*base, "--device", "cuda", "-o", b])
    record(["--replay", a, "--device", "cuda", "-o", c])
    return [compare(a, b, f"{model}.cuda_vs_cuda"), compare(a, c, f"{model}.cuda_self_replay")]


def replays(model: str, base: list[str], fault: bool) -> list[dict]:
    ref = f"{WORK}/{model}.cpu.h5"
    record([*base, "--device", "cpu", "-o", ref])
    found = []
    for tf32 in (0, 1):
        for calibrate in ("cpu", "device"):
            tag = f"{model}.tf32-{'on' if tf32 else 'off'}.calibrate-{calibrate}" + (".fault" if fault else "")
            extra = ["--inject-fault", f"{FAULT[model]}=0.05"] if fault else []
            target = f"{WORK}/{tag}.h5"
            record(["--replay", ref, "--device", "cuda", "--calibrate", calibrate, *extra, "-o", target], tf32)
            found.append(compare(ref, target, tag))
    return found


def compare_steps(reference: str, target: str, tag: str) -> dict:
    """Two multi-step recordings compared: the verdict, the largest judged ratio, the twin's check."""
    code, doc, output = _report(reference, target, tag)
    if doc is None:
        return {"tag": tag, "exit": code, "error": output[-1500:]}
    v, rows = doc["verdict"], doc["steps"]
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None and r["status"] != "not judged"]
    return {"tag": tag, "exit": code, "status": v["status"], "step": v["step"], "basis": v["basis"],
            "statuses": [r["status"] for r in rows], "largest_ratio": max(ratios, default=None),
            "twin_check": doc["meta"]["target"].get("twin_check"), "headline": v["headline"]}


def steps() -> list[dict]:
    """12 steps of the tests' tiny HF Llama (AdamW; a new batch per step, token ids >= 90 first in step 6)."""
    base = [*HF_STEPS, "--steps", "12", "--optimizer", "adamw", "--batch-size", "2"]
    cpu, a, b = (f"{WORK}/steps.{x}.h5" for x in ("cpu", f"{DEVICE}.a", f"{DEVICE}.b"))
    record([*base, "--device", "cpu", "-o", cpu])
    record([*base, "--device", DEVICE, "-o", a])
    record([*base, "--device", DEVICE, "-o", b])
    record(["--replay", a, *HF_STEPS, "--device", DEVICE, "-o", f"{WORK}/steps.self.h5"])
    found = [compare_steps(a, b, f"steps.{DEVICE}_vs_{DEVICE}"),
             compare_steps(a, f"{WORK}/steps.self.h5", f"steps.{DEVICE}_self_replay")]
    for tag, extra, tf32, fault in (("fp32.tf32-off", [], 0, ""), ("fp32.tf32-on", [], 1, ""),
                                    ("bf16", ["--amp", "bf16"], 0, ""),
                                    ("fp32.tf32-off.fault-ids-1pct", [], 0, "ids:90:0.01"),
                                    ("bf16.fault-ids-bf16-only", ["--amp", "bf16"], 0, "ids_lowp:90:2")):
        target = f"{WORK}/steps.{tag}.h5"
        record(["--replay", cpu, *HF_STEPS, "--device", DEVICE, *extra, "-o", target], tf32, fault)
        found.append(compare_steps(cpu, target, f"steps.cpu_to_{DEVICE}.{tag}"))
    return found


def main() -> None:
    if sys.argv[1:2] == ["--cli"]:
        return cli_with_tf32()
    what = sys.argv[1] if len(sys.argv) > 1 else "replays"
    os.makedirs(WORK, exist_ok=True)
    results = steps() if what == "steps" else []
    for row in results:
        print(json.dumps(row), flush=True)
    for model, extra in MODELS.items() if what != "steps" else ():
        base = ["--model", model, *extra, "--batch-size", "8"]
        found = invariance(model, base) if what == "invariance" else replays(model, base, what == "faults")
        for row in found:
            print(json.dumps(row), flush=True)
        results += found
    out = os.environ.get("OUT", WORK)
    with open(f"{out}/{what}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
