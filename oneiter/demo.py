"""`oneiter demo`: the whole loop on this machine's CPU, with a layer broken on purpose.

1. record a reference iteration of a built-in model on the CPU in float32;
2. record a target iteration replaying it (same weights, batch, random masks), on the CPU with bfloat16
   autocast — every layer now differs a little — and a 5 % forward fault injected into one deep layer;
3. compare: the report must name the faulty layer, not the first layer whose accumulated error is large.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from oneiter.errors import OneIterError
from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.results import CompareResult
from oneiter.outputs import resolve_folder
from oneiter.record.options import Amp
from oneiter.record.run import SpecOptions, record

__all__ = ["DemoResult", "run_demo", "DEFAULT_FAULT"]

DEFAULT_FAULT = {"resnet18": "layer3.1.conv2", "mobilenet_v2": "features.12.conv.1.0",
                 "llama_tiny": "layers.1.feed_forward.w2"}
# smaller images than the models' 224 default: the demo's two files stay a few hundred MB (bench/bench_record.py)
DEMO_ARGS = {"resnet18": {"image_size": 96}, "mobilenet_v2": {"image_size": 96}}


@dataclass
class DemoResult:
    reference: Path
    target: Path
    fault: str
    result: CompareResult

    @property
    def named_layer(self) -> str | None:
        verdict = self.result.verdict()
        culprit = verdict.get("culprit") or verdict
        return culprit.get("module")

    @property
    def found(self) -> bool:
        return self.named_layer == self.fault


def run_demo(
    directory: Path,
    *,
    model: str = "resnet18",
    batch_size: int = 8,
    fault: str | None = None,
    amp: Amp | None = "bf16",
    say: Callable[[str], None] = lambda _msg: None,
) -> DemoResult:
    """Record reference and faulty target into `directory` (created; files overwritten) and compare them."""
    fault = fault or DEFAULT_FAULT.get(model)
    if fault is None:
        raise OneIterError(f"no default fault layer for model '{model}': pass --fault PATH")
    directory = resolve_folder(directory, "--dir")
    directory.mkdir(parents=True, exist_ok=True)
    ref, tgt = directory / "reference.h5", directory / "target.h5"
    args = DEMO_ARGS.get(model, {})
    size = f", {args['image_size']}x{args['image_size']} images" if "image_size" in args else ""
    say(f"1/3 reference: {model}, batch {batch_size}{size}, cpu float32 -> {ref}")
    s = record(SpecOptions(out=ref, model=model, batch_size=batch_size, model_args=args, force=True))
    say(f"    {s.num_calls} module calls, {s.file_bytes / 1e6:.0f} MB, {s.seconds:.1f} s")
    say(f"2/3 target: replay on cpu{' with ' + amp + ' autocast' if amp else ''}, 5% forward fault in {fault} -> {tgt}")
    s = record(SpecOptions(out=tgt, replay=ref, amp=amp, faults=[f"{fault}:forward=0.05"], force=True))
    say(f"    {s.num_calls} module calls, {s.file_bytes / 1e6:.0f} MB, {s.seconds:.1f} s")
    say("3/3 compare")
    return DemoResult(ref, tgt, fault, compare_files(ref, tgt))
