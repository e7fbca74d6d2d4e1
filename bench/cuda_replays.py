"""What only a GPU shows: CUDA records against themselves, CPU -> CUDA replays with TF32 off and on, `--calibrate cpu`
and `device`, and an injected fault, on the three built-in models at small sizes.

    python bench/cuda_replays.py invariance   # two CUDA records of one seed compared; a CUDA self-replay
    python bench/cuda_replays.py replays      # clean CPU reference -> CUDA replays: TF32 off/on x calibrate cpu/device
    python bench/cuda_replays.py faults       # the same replays with a 5 % fault in one deep layer
    python bench/cuda_replays.py steps        # 12 steps of the tests' HF Llama: CUDA against CUDA, CPU -> CUDA
                                              # replays (TF32 off/on, bf16) and two faults first hit at step 6
    python bench/cuda_replays.py calibration  # what the calibration checks need a GPU for (below)
    python bench/cuda_replays.py calibration bn replays kernel   # the same; name fewer parts to split it up

From a checkout, nothing installed (the repository root is put on the path; torch with CUDA, h5py, numpy, typer
and rich needed, transformers for `steps`), e.g. on a lent GPU machine, one command:

    OUT=$OUT PYTHONUNBUFFERED=1 python3 bench/cuda_replays.py calibration

`calibration`, in one run: (1) mobilenet_v2 CPU -> CUDA, TF32 off, `--calibrate cpu`: the BatchNorm buffer rows
(running_mean / running_var updates) with their local error, noise and bound, then the worst one bisected: its
BatchNorm run on the recorded input from the reference's buffers with cuDNN (what the replay's rerun runs), with
cuDNN off, on the CPU in float32 and in float64, each update's rel_l2 to the float64 one, and the rerun against the
live update the target recorded (is the rerun of the buffer update faithful to cuDNN's BatchNorm?); (2) resnet18 and
mobilenet_v2 CPU -> CUDA replays, TF32 off/on x `--calibrate cpu/device`, with the verdict, the calibrations not
trusted and the calibration's notes (zero false alarms wanted); (3) llama_tiny with a SiLU kernel 1e-3 off
registered over torch's CUDA kernel only (tests/model_files/faulty_kernels.py, FAULTY_KERNEL_KEY=CUDA), replayed
with both calibrations (the culprit wanted: the call holding the SiLU, `layers.0.feed_forward`). Output in
$OUT/calibration.json. Parts (1) `bn`, (2) `replays` and (3) `kernel` can run in separate calls (the recordings
stay in /tmp/cuda_replays, a missing CPU reference is recorded again; output in $OUT/calibration-<parts>.json).
ONEITER_BENCH_DEVICE=cpu ONEITER_BENCH_SMALL=1 is a dry run on a machine without a GPU (the "CUDA" kernel is then
the CPU's; small sizes).

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
sys.path.insert(0, ROOT)  # oneiter from this checkout, installed or not (bn_bisect imports it; the CLI runs below)
HF_STEPS = ["--model", f"{ROOT}/tests/model_files/hf_llama.py:build_steps", "--model-arg", "layers=1"]
SMALL = bool(os.environ.get("ONEITER_BENCH_SMALL"))  # a dry run's sizes: 32x32 images, 16 tokens, batch 2
MODELS = {"resnet18": ["--model-arg", f"image_size={32 if SMALL else 64}"],
          "mobilenet_v2": ["--model-arg", f"image_size={32 if SMALL else 64}"],
          "llama_tiny": ["--model-arg", f"seq_len={16 if SMALL else 64}"]}
BATCH = "2" if SMALL else "8"
FAULT = {"resnet18": "layer3.1.conv2", "mobilenet_v2": "features.10.conv.1.0", "llama_tiny": "layers.1.feed_forward.w2"}


def cli_with_tf32() -> None:
    """`python cuda_replays.py --cli ARGS`: oneiter's CLI with TF32 set from ONEITER_TF32 (0 or 1) first, and the
    tests' stand-in plugin imported when FAULTY_KERNEL names a kernel to break (as a plugin is, before the run)."""
    import torch

    if os.environ.get("FAULTY_KERNEL"):
        sys.path.insert(0, f"{ROOT}/tests/model_files")
        import faulty_kernels  # noqa: F401 - registers its kernel on import

    tf32 = os.environ.get("ONEITER_TF32")
    if tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32 == "1"
    from oneiter.cli.main import main

    sys.argv = ["oneiter", *sys.argv[2:]]
    main()


def oneiter(args: list[str], tf32: int | None = None, fault: str = "",
            env_extra: dict | None = None) -> tuple[int, str]:
    env = dict(os.environ, ONEITER_NO_PROGRESS="1", ONEITER_TEST_FAULT=fault)  # the model files' faults (faultkit)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # this checkout's oneiter
    env.update(env_extra or {})
    if tf32 is not None:
        env["ONEITER_TF32"] = str(tf32)
    done = subprocess.run([sys.executable, __file__, "--cli", *args], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout + done.stderr


def record(args: list[str], tf32: int | None = None, fault: str = "", env_extra: dict | None = None) -> None:
    started = time.perf_counter()
    code, output = oneiter(["record", *args, "--force"], tf32, fault, env_extra)
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
            "flagged": v.get("num_flagged"), "untrusted": len(v.get("untrusted") or []),
            "warnings": v.get("warnings") or [], "headline": v.get("headline")}


def invariance(model: str, base: list[str]) -> list[dict]:
    a, b, c = (f"{WORK}/{model}.cuda.{x}.h5" for x in "abc")
    record([*base, "--device", "cuda", "-o", a])
    record([*base, "--device", "cuda", "-o", b])
    record(["--replay", a, "--device", "cuda", "-o", c])
    return [compare(a, b, f"{model}.cuda_vs_cuda"), compare(a, c, f"{model}.cuda_self_replay")]


def replays(model: str, base: list[str], fault: bool, device: str = "cuda", reference: bool = True) -> list[dict]:
    """`reference`: record the CPU reference first (False: it was, by `calibration`)."""
    ref = f"{WORK}/{model}.cpu.h5"
    if reference or not os.path.exists(ref):
        record([*base, "--device", "cpu", "-o", ref])
    found = []
    for tf32 in (0, 1):
        for calibrate in ("cpu", "device"):
            tag = f"{model}.tf32-{'on' if tf32 else 'off'}.calibrate-{calibrate}" + (".fault" if fault else "")
            extra = ["--inject-fault", f"{FAULT[model]}=0.05"] if fault else []
            target = f"{WORK}/{tag}.h5"
            record(["--replay", ref, "--device", device, "--calibrate", calibrate, *extra, "-o", target], tf32)
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


def buffer_rows(tag: str) -> list[dict]:
    """The BatchNorm buffer rows of a comparison's JSON report (`compare` wrote it), largest local ratio first."""
    rows = json.load(open(f"{WORK}/{tag}.json"))["rows"]
    found = [{"module": r["module"], "tensor": r["tensor"], "status": r["status"], "rel_l2": r["rel_l2"],
              **{k: (r["local"] or {}).get(k) for k in ("rel_l2", "expected", "calibrated", "bound", "ratio")}}
             for r in rows if r["phase"] == "optimizer" and r["tensor"] in ("running_mean", "running_var")
             and r.get("local")]
    return sorted(found, key=lambda r: -(r["ratio"] or 0.0))


def bn_bisect(reference: str, target: str, module: str) -> dict:
    """One BatchNorm's buffer update, from the reference's buffers and the input it recorded, computed by cuDNN (what
    the replay's rerun on the device runs), by the device with cuDNN off, by the CPU in float32 and in float64."""
    import torch

    from oneiter.format.layout import IterationFile
    from oneiter.format.schema import STATE_AFTER, STATE_BEFORE, call_key, group_path, tensor_path

    def rel(a, b) -> float:
        a, b = a.double().cpu(), b.double().cpu()
        return float((a - b).norm() / b.norm()) if b.norm() else float((a - b).norm())

    with IterationFile(reference) as ref, IterationFile(target) as tgt:
        x = ref.tensor(tensor_path(call_key(module, 0), "forward", "input.0"))
        state = {n: ref.tensor(group_path(STATE_BEFORE, f"{module}.{n}"))
                 for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
        recorded = {n: (ref.tensor(group_path(STATE_AFTER, f"{module}.{n}")),
                        tgt.tensor(group_path(STATE_AFTER, f"{module}.{n}"))) for n in ("running_mean", "running_var")}
    updates = {}
    for name, device, dtype, cudnn in (("cudnn", DEVICE, torch.float32, True), ("device_no_cudnn", DEVICE,
                                       torch.float32, False), ("cpu_float32", "cpu", torch.float32, True),
                                       ("cpu_float64", "cpu", torch.float64, True)):
        bn = torch.nn.BatchNorm2d(x.shape[1]).to(device, dtype).train()
        bn.load_state_dict({k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()})
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=cudnn):
            bn(x.to(device, dtype))
        updates[name] = {"running_mean": bn.running_mean.detach(), "running_var": bn.running_var.detach()}
    exact = updates["cpu_float64"]
    out: dict = {"module": module}
    for buffer in ("running_mean", "running_var"):
        out[buffer] = {name: rel(values[buffer], exact[buffer]) for name, values in updates.items()
                       if name != "cpu_float64"}
        out[buffer]["reference_recorded_vs_cpu_float32"] = rel(recorded[buffer][0], updates["cpu_float32"][buffer])
        out[buffer]["target_recorded_vs_cudnn"] = rel(recorded[buffer][1], updates["cudnn"][buffer])
        out[buffer]["target_recorded_vs_float64"] = rel(recorded[buffer][1], exact[buffer])
    return out


CALIBRATION_PARTS = ("bn", "replays", "kernel")


def calibration(parts: tuple[str, ...] = CALIBRATION_PARTS) -> list[dict]:
    """The calibration checks that need a GPU (module docstring, `calibration`): `parts`, in this order."""
    unknown = sorted(set(parts) - set(CALIBRATION_PARTS))
    if unknown:
        sys.exit(f"calibration: unknown part {', '.join(unknown)} (parts: {', '.join(CALIBRATION_PARTS)})")
    found = []
    base = {m: ["--model", m, *MODELS[m], "--batch-size", BATCH] for m in MODELS}
    # (1) the BatchNorm running_mean false culprit, bisected
    ref = f"{WORK}/mobilenet_v2.cpu.h5"
    if "bn" in parts:
        record([*base["mobilenet_v2"], "--device", "cpu", "-o", ref])
        tag = "mobilenet_v2.bn.tf32-off.calibrate-cpu"
        target = f"{WORK}/{tag}.h5"
        record(["--replay", ref, "--device", DEVICE, "--calibrate", "cpu", "-o", target], 0)
        found.append(compare(ref, target, tag))
        rows = buffer_rows(tag)
        found.append({"tag": f"{tag}.buffer_rows", "rows": rows[:10]})
        if rows:
            found.append({"tag": f"{tag}.bisect", **bn_bisect(ref, target, rows[0]["module"])})
    # (2) the four replays of resnet18 and mobilenet_v2 (mobilenet_v2's reference recorded by (1) when it ran)
    for model in ("resnet18", "mobilenet_v2") if "replays" in parts else ():
        found += replays(model, base[model], False, device=DEVICE, reference=model != "mobilenet_v2")
    # (3) a SiLU kernel wrong on the GPU only, with both calibrations
    if "kernel" not in parts:
        return found
    ref = f"{WORK}/llama_tiny.cpu.h5"
    record([*base["llama_tiny"], "--device", "cpu", "-o", ref])
    wrong = {"FAULTY_KERNEL": "silu", "FAULTY_KERNEL_KEY": "CUDA" if DEVICE.startswith("cuda") else "CPU"}
    for calibrate in ("cpu", "device"):
        tag = f"llama_tiny.silu-wrong-on-{DEVICE}.calibrate-{calibrate}"
        record(["--replay", ref, "--device", DEVICE, "--calibrate", calibrate, "-o", f"{WORK}/{tag}.h5"], 0,
               env_extra=wrong)
        found.append(compare(ref, f"{WORK}/{tag}.h5", tag))
    return found


def main() -> None:
    if sys.argv[1:2] == ["--cli"]:
        return cli_with_tf32()
    what = sys.argv[1] if len(sys.argv) > 1 else "replays"
    os.makedirs(WORK, exist_ok=True)
    parts = tuple(sys.argv[2:]) or CALIBRATION_PARTS
    results = steps() if what == "steps" else calibration(parts) if what == "calibration" else []
    for row in results:
        print(json.dumps(row), flush=True)
    for model, extra in MODELS.items() if what not in ("steps", "calibration") else ():
        base = ["--model", model, *extra, "--batch-size", BATCH]
        found = invariance(model, base) if what == "invariance" else replays(model, base, what == "faults")
        for row in found:
            print(json.dumps(row), flush=True)
        results += found
    out = os.environ.get("OUT", WORK)
    name = what if what != "calibration" or parts == CALIBRATION_PARTS else f"{what}-{'-'.join(parts)}"
    with open(f"{out}/{name}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
