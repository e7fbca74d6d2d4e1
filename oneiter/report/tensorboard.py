"""`oneiter compare --tensorboard DIR`: the comparison as TensorBoard curves, histograms and a text verdict.

Sits after the engine and `CompareResult.to_json` (its input is the JSON document, or a CompareResult); the
recordings are opened again only to read the tensors of the divergent rows for the histograms. Written with
tensorboard's own event writer and protos: neither TensorFlow nor torch is imported. What lands in DIR:

- ``rel_l2/<phase>``         (scalars) the accumulated relative error of every measured row of that phase
  (forward, backward, param_grad, optimizer); the step is the row's causal position, the `#` of the terminal and
  HTML tables, so the four phases follow each other on one x axis. Switch the y axis to log scale to read it.
- ``local_rel_l2/<phase>``, ``expected_noise/<phase>``, ``local_ratio/<phase>`` (scalars) where the target
  recorded per-layer local results: the layer's own, upstream-free error, the noise expected from it and their
  ratio (the JSON rows' ``local``).
- ``error/<module>@<call>/<phase>/<tensor>`` (histograms) the elementwise error target - reference (finite
  elements, in float64) of the first `max_histograms` divergent rows, at the row's step.
- ``verdict`` (text) the verdict in the words of the terminal and HTML reports
  (`judge.iteration.statement.Verdict.from_dict`).
- ``entries`` (text) which entry each step is: a table `step | entry | status` (the scalars' x axis is the row
  number; hovering a point shows the step, this table names it).

Reading the curves: TensorBoard smooths scalars by default (0.6) and "Ignore outliers in chart scaling" may clip the
y axis: both hide exactly what this is for (a 12.8x spike at one layer, drawn as a slow tail). Set smoothing to 0,
untick the outliers box and use a log y axis (docs/reports.md).

One comparison per DIR: TensorBoard merges every event file of a folder into one run, so a second comparison
written into the same folder mixes its curves with the first (a warning says so). Use DIR/<name> per comparison
to see several side by side.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np

from oneiter.errors import warn
from oneiter.format.layout import IterationFile
from oneiter.format.numbers import flat_numbers
from oneiter.formatting import num
from oneiter.judge.iteration.entries import PHASES
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.iteration.verdict import entry_name
from oneiter.outputs import resolve_folder
from oneiter.report.html import Document, as_document, culprit_row, find_row, verdict_of

__all__ = ["write_tensorboard", "MAX_HISTOGRAMS", "NUM_BINS"]

MAX_HISTOGRAMS = 20  # divergent rows that get an error histogram
NUM_BINS = 64
LOCAL_TAGS = (("local_rel_l2", "rel_l2"), ("expected_noise", "expected"), ("local_ratio", "ratio"))


def write_tensorboard(
    result: Union[CompareResult, Document],
    log_dir: Union[str, os.PathLike],
    ref_path: Optional[Union[str, os.PathLike]] = None,
    tgt_path: Optional[Union[str, os.PathLike]] = None,
    *,
    max_histograms: int = MAX_HISTOGRAMS,
) -> Path:
    """Write the comparison into `log_dir` (created) as one event file; returns the event file's path.

    `result` is a CompareResult or the dict of `CompareResult.to_json`. `ref_path`/`tgt_path` are the recordings the
    histograms read (default: the paths the result names); histograms are left out when `max_histograms` is 0.
    """
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    doc = as_document(result)
    log_dir = resolve_folder(log_dir, "--tensorboard")  # a folder (through symlinks), never a file or device
    log_dir.mkdir(parents=True, exist_ok=True)
    if any(log_dir.glob("events.out.tfevents.*")):
        warn(f"{log_dir} already holds event files: TensorBoard will mix this comparison with them (write each "
             "comparison into its own folder)")
    # the pid alone is not unique enough: two comparisons in one process within a second would share a name
    suffix = f".oneiter.{time.time_ns()}"
    writer = EventFileWriter(str(log_dir), filename_suffix=suffix)
    try:
        _write_text(writer, "verdict", _verdict_markdown(doc))
        _write_text(writer, "entries", _entries_markdown(doc))
        _write_scalars(writer, doc)
        if max_histograms > 0:
            paths = (ref_path or doc["reference"], tgt_path or doc["target"])
            _write_histograms(writer, doc, *paths, limit=max_histograms)
        writer.flush()
    finally:
        writer.close()
    # the unique suffix names the file (EventFileWriter has no public accessor for its name)
    return next(log_dir.glob(f"events.out.tfevents.*{suffix}"))


# -- protos ---------------------------------------------------------------------------------------------------------
def _add(writer, summary, step: int) -> None:
    from tensorboard.compat.proto.event_pb2 import Event

    writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))


def _scalar(tag: str, value: float):
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=value)])


def _write_text(writer, tag: str, text: str) -> None:
    """A text summary the text dashboard shows (markdown), stored as a 1-element string tensor."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8", "backslashreplace")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    _add(writer, Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)]), 0)


def _histogram(tag: str, values: np.ndarray):
    """A histogram proto of finite float64 values (TensorBoard keeps right bin edges; an empty left bin is added)."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

    lo, hi = float(values.min()), float(values.max())
    if lo == hi:  # one value (all errors equal, e.g. zero): one narrow bin around it
        counts, edges = np.array([values.size]), np.array([lo - 1e-12 - abs(lo) * 1e-6, hi])
    else:
        counts, edges = np.histogram(values, bins=NUM_BINS, range=(lo, hi))
    proto = HistogramProto(
        min=lo, max=hi, num=int(values.size), sum=float(values.sum()), sum_squares=float(np.dot(values, values)),
        bucket_limit=[float(edges[0])] + [float(e) for e in edges[1:]], bucket=[0.0] + [float(c) for c in counts],
    )
    return Summary(value=[Summary.Value(tag=tag, histo=proto)])


# -- content --------------------------------------------------------------------------------------------------------
def _verdict_markdown(doc: Document) -> str:
    verdict = verdict_of(doc)
    title, reason, details = verdict.title, verdict.reason, verdict.details
    runs = [f"- {label}: `{doc.get(label, '')}` "
            + ", ".join(f"{k} {v}" for k, v in doc.get("meta", {}).get(label, {}).items() if v not in (None, ""))
            for label in ("reference", "target")]
    return "\n\n".join([f"**{title}**" + (f": {reason}" if reason else ""), *details, "\n".join(runs)])


def _entries_markdown(doc: Document) -> str:
    """Step -> entry: what each x of the scalar curves is (markdown, escaped)."""
    lines = ["| step | entry | status |", "|---:|---|---|"]
    for step, row in enumerate(doc["rows"]):
        name = entry_name(row).replace("|", "\\|").replace("`", "'")
        lines.append(f"| {step} | `{name}` | {row['status']} |")
    return "\n".join(lines)


def _write_scalars(writer, doc: Document) -> None:
    """rel_l2/<phase> for every measured row; local_*/<phase> where the row carries local results."""
    for step, row in enumerate(doc["rows"]):
        phase = row["phase"] if row["phase"] in PHASES else "other"
        value = num(row.get("rel_l2"))
        if value is not None:
            _add(writer, _scalar(f"rel_l2/{phase}", value), step)
        local = row.get("local")
        if isinstance(local, dict):
            for tag, key in LOCAL_TAGS:
                measured = num(local.get(key))
                if measured is not None:
                    _add(writer, _scalar(f"{tag}/{phase}", measured), step)


def _write_histograms(writer, doc: Document, ref_path, tgt_path, *, limit: int) -> None:
    """Elementwise target - reference of up to `limit` measured rows outside tolerance (diverged, drift, rounding): the
    culprit and the NaN/Inf origin (when the document names them), then the rest in causal order; a tensor stored
    once under two names (a layer's output is the next one's input) gets one histogram."""
    verdict = verdict_of(doc)
    named = [culprit_row(doc, verdict), find_row(doc, verdict.nan_origin)]
    order = [i for i in named if i is not None] + list(range(len(doc["rows"])))
    seen, done = set(), 0
    with IterationFile(ref_path) as ref, IterationFile(tgt_path) as tgt:
        ref_paths, tgt_paths = _paths(ref), _paths(tgt)
        for i in order:
            row = doc["rows"][i]
            key = (row["module"], row["call"], row["phase"], row["tensor"])
            outside = row["status"] in ("diverged", "drift", "rounding")
            if done >= limit or not outside or key not in ref_paths or key not in tgt_paths:
                continue  # also rows of a document made from other files than these
            ident = (ref.file[ref_paths[key]].id, tgt.file[tgt_paths[key]].id)
            if ident in seen:
                continue
            seen.add(ident)
            diff = _difference(ref.read(ref_paths[key]), tgt.read(tgt_paths[key]))
            if diff is not None:
                _add(writer, _histogram("error/" + entry_name(row).replace(" ", "/"), diff), i)
                done += 1


def _difference(a: np.ndarray, b: np.ndarray) -> Optional[np.ndarray]:
    """Finite elements of b - a in float64 (None if the shapes differ or nothing is finite)."""
    if a.shape != b.shape:
        return None
    diff = flat_numbers(b).astype(np.float64) - flat_numbers(a).astype(np.float64)
    diff = diff[np.isfinite(diff)]
    return diff if diff.size else None


def _paths(f: IterationFile) -> dict[tuple, str]:
    """(module, call, phase, tensor) -> dataset path, from the file's own entries (the layout stays in format)."""
    return {e.key: e.path for e in f.entries()}
