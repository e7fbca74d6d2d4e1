"""Write one cycle's Chrome trace: a readable name, gzip at the fast level, backward module spans on their own track.

Where it sits: called once per active cycle by the trace handler (`steps.CycleExporter`), which is the only
place oneiter exports anything — torch.profiler allows one export per trace ("Trace is already saved"), and this
module makes exactly one `export_chrome_trace` call, to a temporary `.json` next to the final file.

- Name: `<model>_<device>_rank<R>_steps<first>-<last>.pt.trace.json.gz` (plus `_<dtype>`/`_amp-<x>` when not
  float32), e.g. `resnet18_cpu_rank0_steps2-3.pt.trace.json.gz`. The `.pt.trace.json.gz` ending is what
  TensorBoard's PyTorch profiler plugin looks for in a `--logdir`; Perfetto and chrome://tracing open it as is.
- gzip level 1: ~10x smaller than the JSON in a few ms, where torch's own `.gz` export uses level 9 (85-270 ms).
- The backward markers of `module_ranges.py` become spans `oneiter.bwd::<path>` on a track named
  "oneiter: backward by module" right under the thread that ran the backward, and the markers are dropped.
  Traces above `REWRITE_LIMIT` bytes are gzipped unchanged (markers kept) to bound memory and time.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from oneiter.outputs import file_in
from oneiter.profile.module_ranges import BWD, FWD, split_marker

__all__ = ["TRACE_SUFFIX", "REWRITE_LIMIT", "trace_stem", "write_trace", "read_trace"]

TRACE_SUFFIX = ".pt.trace.json.gz"
REWRITE_LIMIT = 256 * 2**20
GZIP_LEVEL = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def _model_label(spec: str) -> str:
    if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
        path, _, func = spec.rpartition(":")
        spec = f"{Path(path).stem}-{func}"
    return _UNSAFE.sub("-", spec).strip("-") or "model"


def trace_stem(model: str, device: str, rank: int, steps: list[int], dtype: str = "float32",
               amp: str | None = None) -> str:
    """`resnet18_cpu_rank0_steps2-3`: what was profiled, where, and which steps, without a timestamp."""
    parts = [_model_label(model), _UNSAFE.sub("", device.replace(":", "")), f"rank{rank}"]
    if dtype != "float32":
        parts.append(dtype)
    if amp:
        parts.append(f"amp-{amp}")
    step_text = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    return "_".join(parts + [f"steps{step_text}"])


def write_trace(prof, path: Path) -> dict[str, Any]:
    """Export `prof`'s trace once, rewrite it (backward spans, trace name) and gzip it to `path`."""
    start = time.perf_counter()
    tmp = file_in(path.parent, f".{path.name}.tmp.json", "--out")  # never a link planted there
    try:
        prof.export_chrome_trace(str(tmp))
        json_bytes = tmp.stat().st_size
        rewritten = json_bytes <= REWRITE_LIMIT
        if rewritten:
            with open(tmp, encoding="utf-8") as fh:
                data = json.load(fh)
            num_spans = _backward_spans(data)
            data["traceName"] = path.name
            payload = json.dumps(data, separators=(",", ":")).encode("utf-8")  # C encoder: json.dump is ~5x slower
            del data
            with gzip.open(path, "wb", compresslevel=GZIP_LEVEL) as out:
                out.write(payload)
        else:
            num_spans = 0
            with open(tmp, "rb") as fin, gzip.open(path, "wb", compresslevel=GZIP_LEVEL) as out:
                shutil.copyfileobj(fin, out, 4 * 2**20)
    finally:
        if tmp.exists():
            os.unlink(tmp)
    return {
        "trace": path.name,
        "trace_bytes": path.stat().st_size,
        "trace_json_bytes": json_bytes,
        "backward_spans": num_spans,
        "rewritten": rewritten,
        "export_seconds": round(time.perf_counter() - start, 4),
    }


def _backward_spans(data: dict) -> int:
    """Replace each begin/end marker pair by one span on a per-thread 'backward by module' track."""
    events = data.get("traceEvents", [])
    begins: dict[str, dict] = {}
    spans: list[dict] = []
    kept: list[dict] = []
    for evt in events:
        name = evt.get("name", "")
        marker = split_marker(name)
        if marker is not None and marker[0] == "begin":
            begins[marker[1]] = evt
        elif marker is not None:
            label = marker[1]
            begin = begins.pop(label, None)
            if begin is not None:
                path, _, call = label.rpartition("@")
                spans.append({
                    "ph": "X", "cat": "user_annotation", "name": BWD + path,
                    "pid": begin["pid"], "tid": begin["tid"], "ts": begin["ts"],
                    "dur": round(max(float(evt["ts"]) - float(begin["ts"]), 0.0), 3), "args": {"call": int(call)},
                })  # fmt: skip
        else:
            if name.startswith(FWD):
                evt["cat"] = "user_annotation"  # oneiter's own ranges, not ops
            kept.append(evt)
    kept.extend(begins.values())  # a begin without its end (should not happen): keep it as it was
    tracks = _tracks(spans, kept)
    for span in spans:
        span["tid"] = tracks[(span["pid"], span["tid"])]
    data["traceEvents"] = kept + spans
    return len(spans)


def _tracks(spans: list[dict], kept: list[dict]) -> dict[tuple, int]:
    """A new integer tid per (pid, tid) that ran backward spans, named and sorted right after that thread."""
    used = {e["tid"] for e in kept if isinstance(e.get("tid"), int)}
    next_tid = max(used | {0}) + 1
    tracks: dict[tuple, int] = {}
    for span in spans:
        key = (span["pid"], span["tid"])
        if key not in tracks:
            tracks[key] = next_tid
            next_tid += 1
            sort = key[1] if isinstance(key[1], int) else 0
            kept.append({"ph": "M", "name": "thread_name", "pid": key[0], "tid": tracks[key],
                         "args": {"name": f"oneiter: backward by module (thread {key[1]})"}})  # fmt: skip
            kept.append({"ph": "M", "name": "thread_sort_index", "pid": key[0], "tid": tracks[key],
                         "args": {"sort_index": sort}})  # fmt: skip
    return tracks


def read_trace(path: Path) -> dict:
    """Load a `.pt.trace.json.gz` (or plain `.json`) written by oneiter."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)
