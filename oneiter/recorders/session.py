"""A recording session: the writer, the tensor sink and the module hooks for one iteration, in one object.

`record()` (the CLI), the mmengine hook and multi-rank runs all record through this class, so the file format
and the invariants (inputs before in-place ops, every call kept, numbers unchanged) live in one place.

    with atomic_output(out, force) as tmp, RecordingSession(model, tmp, meta) as session:
        session.state_before(); session.batch(inputs)
        with session.capture():
            ... forward, loss ...; session.phase = "backward"; loss.backward()
            session.param_grads()
            optimizer.step()
        session.state_after(); session.finish(loss)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import OneIterError
from ..fileformat import BATCH, LOSS, PARAM_GRADS, STATE_AFTER, STATE_BEFORE
from .capture import ModuleCapture, TensorSink
from .writer import DEFAULT_QUEUE_BYTES, BackgroundWriter

__all__ = ["RecordingSession", "atomic_output", "check_output"]


def check_output(out: Path, force: bool) -> Path:
    """Refuse to overwrite an existing file without --force, and fail early on a missing directory."""
    out = Path(out)
    if out.is_dir():
        raise OneIterError(f"output '{out}' is a directory; give a file name such as {out / 'run.h5'}")
    if out.exists() and not force:
        raise OneIterError(f"output '{out}' already exists; pass --force to overwrite it")
    if not out.parent.exists():
        raise OneIterError(f"output directory '{out.parent}' does not exist")
    return out


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary path beside `out`; rename it to `out` only if the block succeeds, else delete it."""
    out = check_output(out, force)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if out.exists() and not force:
            raise OneIterError(f"output '{out}' appeared while recording; pass --force to overwrite it")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


class RecordingSession:
    """Records one iteration of `model` into `path` (a temporary path: see `atomic_output`)."""

    def __init__(
        self,
        model,
        path: Path,
        meta: dict[str, Any],
        *,
        select: Callable[[str], bool] = lambda _path: True,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        progress: Callable[[str, int], None] | None = None,
        probe_factory: Callable[[TensorSink], Any] | None = None,
        keep_values: bool = False,
    ):
        """`probe_factory(sink)` makes the local-error probe (`probe.LocalProbe`); `keep_values` keeps every host
        copy in `sink.keep` (the source of `--against cpu`, which reruns each call after backward)."""
        self.model = model
        self.phase = "forward"
        self.writer = BackgroundWriter(path, meta, max_bytes=queue_bytes)
        on_capture = (lambda n: progress(self.phase, n)) if progress else None
        self.sink = TensorSink(self.writer, on_capture=on_capture, keep={} if keep_values else None)
        self.probe = probe_factory(self.sink) if probe_factory else None
        if self.probe is not None:
            self.probe.bind(model)
        self.module_capture = ModuleCapture(model, self.sink, select, self.probe)
        self._finished = False

    def __enter__(self) -> "RecordingSession":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        self.module_capture.detach()
        if not self._finished:
            self.writer.abort()

    @contextmanager
    def capture(self) -> Iterator[ModuleCapture]:
        """Module hooks attached for the duration of the block (forward and backward)."""
        with self.module_capture as capture:
            yield capture

    def bind_optimizer(self, optimizer) -> None:
        """The optimizer that steps this iteration: the probe judges its update (teacher forced)."""
        if self.probe is not None:
            self.probe.bind(self.model, optimizer)

    def attach_random(self, mode) -> None:
        """The random-op mode of the iteration (recorder or replayer): calls note which random ops they ran."""
        self.module_capture.random_count = lambda: mode.num_ops
        if self.probe is not None and getattr(mode, "recorded", None) is not None:
            self.probe.random_ops = mode.recorded  # --against cpu: its own values, filled as the run goes

    def after_backward(self) -> None:
        """Backward is done (the optimizer has not stepped): run the probes that needed every value."""
        if self.probe is not None:
            with self.module_capture.suspended():
                self.probe.after_backward()

    def state_before(self) -> None:
        self._named(STATE_BEFORE, self.model.state_dict(keep_vars=True).items())

    def batch(self, inputs) -> None:
        for i, tensor in enumerate(inputs):
            self.sink.put(BATCH, f"input.{i}", tensor)

    def param_grads(self) -> None:
        self.phase = "parameters"
        grads = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        self._named(PARAM_GRADS, grads)

    def state_after(self) -> None:
        self._named(STATE_AFTER, self.model.state_dict(keep_vars=True).items())

    def finish(self, loss, attrs: dict[str, Any] | None = None) -> tuple[int, int]:
        """Write the loss, mark the file complete and close it. Returns (datasets incl. links, tensor bytes)."""
        self.sink.put("", LOSS, loss)
        if self.probe is not None:
            self.writer.local_table(*self.probe.table(self.module_capture.seqs))
        final = {"num_calls": self.module_capture.num_calls, "loss": float(loss.detach().float()), **(attrs or {})}
        result = self.writer.close(final)
        self._finished = True
        return result

    def _named(self, group: str, named) -> None:
        names = []
        for name, tensor in named:
            # parameters and buffers are never deduplicated: kernels update some buffers (BatchNorm's running
            # stats) without bumping their version counter
            self.sink.put(group, name, tensor, dedup=False)
            names.append(name)
        self.writer.attrs(group, {"order": names})
