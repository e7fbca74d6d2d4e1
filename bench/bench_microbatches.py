"""What an iteration of K microbatches (gradient accumulation) costs to record and to replay, against the plain
iteration, on the tiny Hugging Face Llama of the tests (`tests/model_files/hf_llama.py`: hidden 32, 2 layers,
sequences of 8 tokens, 2 rows per microbatch, AdamW).

    python bench/bench_microbatches.py                  # K = 1, 2, 8; 3 repeats each (~3 min on 2 quiet cores)
    python bench/bench_microbatches.py --ks 1 4 --repeat 5 --json out.json

One iteration is K forwards and `(loss / K).backward()`s, gradient clipping and one AdamW step. For each K, in one
process after one unrecorded warm-up iteration (kernels and allocator warm):
- `plain`: the iteration without oneiter (median of `--repeat` runs, each from the same weights);
- `record`: the same iteration inside an `oneiter.Recorder` (the reference: every call's tensors, each
  microbatch's batch and loss, the gradients kept after each backward), the file written and renamed;
- `replay`: a `Recorder(replay=...)` of that reference from other weights (its weights, AdamW state and each
  microbatch's batch loaded; every call rerun teacher-forced and its noise calibrated: the per-call probes);
- the reference's file size, per microbatch (size / K) and the marginal size of one more microbatch
  ((size_K - size_1) / (K - 1)).
Seconds are medians over `--repeat` runs with [min-max]; on a shared machine one run varies by +-30 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "model_files"))

import hf_llama  # noqa: E402

import oneiter  # noqa: E402

ROWS = 2  # per microbatch


def _build(seed: int, k: int):
    torch.manual_seed(seed)
    model, (ids,), _ = hf_llama.build(ROWS * k)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), ids


def _iteration(model, opt, ids, k: int, rec=None) -> None:
    for chunk in ids.chunk(k):
        x = rec.inputs(chunk) if rec is not None else chunk
        (model(input_ids=x, labels=x).loss / k).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(k: int, repeat: int, folder: Path) -> dict:
    model, opt, ids = _build(0, k)
    _iteration(model, opt, ids, k)  # warm-up (its step moves the weights: every measured run starts from these)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    plain, record, replay = [], [], []
    ref = folder / f"ref{k}.h5"
    for _ in range(repeat):
        model.load_state_dict(start)
        plain.append(_timed(lambda: _iteration(model, opt, ids, k)))
    for _ in range(repeat):
        model.load_state_dict(start)

        def recorded():
            with oneiter.Recorder(model, ref, optimizer=opt, force=True) as rec:
                _iteration(model, opt, ids, k, rec)

        record.append(_timed(recorded))
    target, topt, tids = _build(1, k)  # other weights and data: the replay loads the reference's
    _iteration(target, topt, tids, k)
    for _ in range(repeat):
        def replayed():
            with oneiter.Recorder(target, folder / f"tgt{k}.h5", optimizer=topt, replay=ref, force=True) as rec:
                _iteration(target, topt, tids, k, rec)

        replay.append(_timed(replayed))
    verdict = oneiter.compare(ref, folder / f"tgt{k}.h5").verdict_obj.headline.split(":")[0]
    return {"k": k, "plain": plain, "record": record, "replay": replay, "bytes": ref.stat().st_size,
            "verdict": verdict}


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 8], help="microbatch counts to measure")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    opts = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(k, opts.repeat, Path(tmp)) for k in opts.ks]
    one = next((r["bytes"] for r in rows if r["k"] == 1), None)
    print(f"tiny Llama (hidden 32, 2 layers, seq 8), {ROWS} rows per microbatch, AdamW; "
          f"{torch.get_num_threads()} threads; seconds: median [min-max] of {opts.repeat}")
    print(f"{'K':>3} {'plain s':>22} {'record s':>22} {'x plain':>8} {'replay s':>22} {'x plain':>8} "
          f"{'file KB':>8} {'KB/microbatch':>14} {'KB marginal':>12}  replay verdict")
    for r in rows:
        plain = statistics.median(r["plain"])
        marginal = (r["bytes"] - one) / (r["k"] - 1) / 1e3 if one is not None and r["k"] > 1 else float("nan")
        print(f"{r['k']:>3} {_cell(r['plain']):>22} {_cell(r['record']):>22} "
              f"{statistics.median(r['record']) / plain:>8.1f} {_cell(r['replay']):>22} "
              f"{statistics.median(r['replay']) / plain:>8.1f} {r['bytes'] / 1e3:>8.0f} "
              f"{r['bytes'] / r['k'] / 1e3:>14.0f} {marginal:>12.0f}  {r['verdict']}")
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
