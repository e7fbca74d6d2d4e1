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

import glob
import os
import signal
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from oneiter.errors import OneIterError
from oneiter.format.schema import (
    BATCH,
    LOSS,
    MICROBATCH_LOSS,
    OPTIMIZER,
    PARAM_GRADS,
    STATE_AFTER,
    STATE_BEFORE,
    STEP_GRADS,
    STEP_START,
    UNREDUCED_GRADS,
    arg_name,
    shard_attrs,
)
from oneiter.format.writer import DEFAULT_QUEUE_BYTES, BackgroundWriter
from oneiter.outputs import resolve
from oneiter.record.capture.hooks import ModuleCapture, unscaled
from oneiter.record.capture.sink import TensorSink, host_copy
from oneiter.record.local.clipping import squared_norms, step_figures
from oneiter.runtime.names import parameters, state_tensors
from oneiter.runtime.sharding import is_dtensor, placement_of, shard_of

__all__ = ["RecordingSession", "atomic_output", "check_output", "remove_stale_temps", "OutputExists"]


class OutputExists(OneIterError, FileExistsError):
    """The output file exists and overwriting it was not asked for."""


def check_output(out: Path, force: bool) -> Path:
    """The regular file a recording goes to: `out`, or the file a symlink `out` leads to (written there, so the
    link stays a link: `oneiter.outputs.resolve`). Refuses a directory, a device, a FIFO, a socket, a missing
    folder, and an existing file without `force`."""
    out = Path(out)
    if out.is_dir():
        raise OneIterError(f"out '{out}' is a directory; give a file name such as {out / 'run.h5'}", param="out")
    target = resolve(out, "out", streams=False).path
    assert target is not None  # a regular file (streams=False refuses the rest) always has its path
    if target.exists() and not force:
        raise OutputExists(f"out '{out}' already exists; pass force=True to overwrite it", param="out")
    return target


def _temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-{socket.gethostname()}-"


def remove_stale_temps(out: Path) -> list[Path]:
    """Delete temporary files beside `out` left by processes of this host that no longer run (a killed record);
    returns them. Files of live processes, and of other hosts (a shared filesystem), are left alone."""
    removed = []
    prefix = _temp_prefix(out)
    for path in out.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix):]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP (how Slurm, Kubernetes and a closed terminal stop a job) raise SystemExit while the
    block runs, so `finally` clauses delete temporary files; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary path beside `out`; rename it to `out` only if the block succeeds, else delete it (also on
    SIGTERM/SIGHUP). Stale temporary files of killed runs are removed first."""
    given, out = out, check_output(out, force)
    remove_stale_temps(out)
    tmp = out.with_name(f"{_temp_prefix(out)}{os.getpid()}")
    try:
        with _terminate_as_exit():
            yield tmp
        if out.exists() and not force:
            raise OutputExists(f"out '{given}' appeared while recording; pass force=True to overwrite it",
                               param="out")
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
        stats_groups: Callable[[str], bool] | None = None,
    ):
        """`probe_factory(sink)` makes the local-error probe (`probe.LocalProbe`); `keep_values` keeps every host
        copy in `sink.keep` (the source of `--against cpu`, which reruns each call after backward);
        `stats_groups(group)` says which groups hold statistics only (`--level stats`)."""
        self.model = model
        self.phase = "forward"
        self.progress = progress
        self.writer = BackgroundWriter(path, meta, max_bytes=queue_bytes)
        on_capture = (lambda n: progress(self.phase, n)) if progress else None
        self.sink = TensorSink(self.writer, on_capture=on_capture, keep={} if keep_values else None,
                               stats_groups=stats_groups)
        self.probe = probe_factory(self.sink) if probe_factory else None
        if self.probe is not None:
            self.probe.bind(model)
        self.module_capture = ModuleCapture(model, self.sink, select, self.probe)
        self.extra_attrs: dict[str, Any] = {}  # more root attributes, written by finish()
        self._finished = False
        self._unreduced: dict[str, Any] | None = None  # parameter -> its unreduced gradient (`watch_unreduced`)
        self._grad_hooks: list = []
        self._kept: list | None = None  # the gradients as the last backward left them (`keep_grads`)

    def __enter__(self) -> "RecordingSession":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        self.module_capture.detach()
        self._unwatch()
        if not self._finished:
            self.writer.abort()

    @contextmanager
    def capture(self) -> Iterator[ModuleCapture]:
        """Module hooks attached for the duration of the block (forward and backward)."""
        with self.module_capture as capture:
            yield capture

    def bind_block(self, reference_calls, optimizers: list, optimizer_start: str) -> None:
        """What this session needs of a Recorder's block: the reference's calls to number each module's calls as it
        did (`hooks.pair_with`; None: no reference), the optimizer (when there is one) and where it starts."""
        if reference_calls is not None:
            self.module_capture.pair_with(reference_calls)
        if len(optimizers) == 1:
            self.bind_optimizer(optimizers[0])
        if self.probe is not None:
            self.probe.optimizer_start = optimizer_start

    def attach_modes(self, modes, *, sharded: bool) -> None:
        """A Recorder block's modes (`record/modes/active.py`): its random values and collectives seen through this
        session; unless the model is `sharded`, each rank's own gradients kept before a reducer averages them."""
        self.attach_random(modes.random)
        self.attach_collectives(modes.collectives)
        if modes.collectives is not None and not sharded:
            self.watch_unreduced()  # DDP's reducer may average them: each rank's own are kept

    def bind_optimizer(self, optimizer) -> None:
        """The optimizer that steps this iteration: the probe judges its update (teacher forced)."""
        if self.probe is not None:
            self.probe.bind(self.model, optimizer)

    def attach_collectives(self, mode) -> None:
        """The collective recorder of the iteration (`record/modes/collectives.py`; None: no process group): reruns
        force each call's collectives; `--against cpu` reruns from this run's own, filled as the run goes."""
        if mode is not None and self.probe is not None and self.probe.SOURCE_IS_RUN:
            self.probe.collectives = mode.recorded

    def live_collective(self, record, phase: str, outputs: dict) -> None:
        """A collective's live outputs by path (`CollectiveRecorder.on_output`), for the probe's fidelity check."""
        if self.probe is not None:
            self.probe.live_collective(record, phase, outputs)

    def watch_unreduced(self) -> None:
        """Keep each parameter's gradient as this rank's backward leaves it (a host copy, taken when autograd has
        accumulated it and before DistributedDataParallel's reducer, whose hook runs after, averages it over ranks):
        `param_grads(unreduced=True)` stores them. Costs one host copy of the gradients until then."""
        self._unreduced = {}
        for name, param in self.model.named_parameters():
            if param.requires_grad and hasattr(param, "register_post_accumulate_grad_hook"):
                self._grad_hooks.append(param.register_post_accumulate_grad_hook(self._keeper(name)))

    def _keeper(self, name: str):
        def keep(param) -> None:
            if self._unreduced is not None and param.grad is not None:
                self._unreduced[name] = host_copy(param.grad)

        return keep

    def _unwatch(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()

    def attach_random(self, mode) -> None:
        """The random-op mode of the iteration (recorder or replayer): calls note which random ops they ran."""
        self.module_capture.random_count = lambda: mode.num_ops
        if self.probe is not None and getattr(mode, "recorded", None) is not None:
            self.probe.random_ops = mode.recorded  # --against cpu: its own values, filled as the run goes

    def after_backward(self, *, step_later: bool = False) -> None:
        """Backward is done (the optimizer has not stepped): run the probes that needed every value. `step_later`:
        the optimizer's update is judged by `before_step`, right before it steps."""
        if self.probe is not None:
            with self.module_capture.suspended():
                self.probe.after_backward(step_later=step_later)

    def gradients_divided(self, divisors: dict[str, float]) -> None:
        """Code between the last backward and the step divided these parameters' gradients (name -> by what: a
        pipeline schedule's scaling by the number of microbatches): the optimizer's update is judged from the
        reference's gradients divided alike."""
        if self.probe is not None and getattr(self.probe, "rerunner", None) is not None:
            self.probe.rerunner.grad_divisor.update(divisors)

    def before_step(self, grads_changed: bool) -> None:
        """The optimizer is about to step (after `after_backward(step_later=True)`): the gradients as it sees them
        (`step_grads`), then the probe judges the step."""
        figures = self.step_grads(grads_changed)
        if self.probe is not None:
            with self.module_capture.suspended():
                self.probe.before_step(grads_changed=grads_changed, figures=figures)

    def step_grads(self, changed: bool) -> dict | None:
        """Where code between backward and the step changed the gradients (`changed`: clipping, unscaling), store them
        as the step sees them (`/step_grads`) with their figures against what backward left (`record/local/
        clipping.py`); return the figures (coefficient 1 where nothing changed; None: not measured, a sharded
        gradient)."""
        before = getattr(self, "_grad_norms", None)
        if before is None:
            return None
        named = [(n, p.grad) for n, p in parameters(self.model) if p.grad is not None]
        if not changed:
            return {"coefficient": 1.0, "grad_norm": sum(before.values()) ** 0.5, "own": {}, "count": len(named),
                    "largest": max((g.numel() for _, g in named), default=1),
                    "dtype": str(named[0][1].dtype).removeprefix("torch.") if named else "float32"}
        figures = step_figures(before, named)
        self._named(STEP_GRADS, named)
        self.writer.attrs(STEP_GRADS, {k: float(figures[k]) for k in ("coefficient", "grad_norm", "step_norm",
                                                                     "spread")})
        return figures

    def state_before(self) -> None:
        state = state_tensors(self.model)
        self._named(STATE_BEFORE, [(name, t) for name, t, _ in state])
        self._versions = {name: t._version for name, t, is_param in state if is_param}

    def step_start(self) -> None:
        """The parameters the model itself wrote in place since `state_before` (nn.Embedding(max_norm) renormalises
        rows in forward), as the optimizer step will find them: where its update starts (`STEP_START`)."""
        versions = getattr(self, "_versions", {})
        written = [(name, t) for name, t, is_param in state_tensors(self.model)
                   if is_param and name in versions and t._version != versions[name] and not is_dtensor(t)]
        if written:
            self._named(STEP_START, written)

    def optimizer_state(self, entries) -> None:
        """The optimizer's state as the step begins: (`<parameter>.<key>`, tensor) pairs
        (`record/start/optimizer_start.py`), none for a stateless optimizer."""
        if entries:
            self._named(OPTIMIZER, entries)

    def batch(self, inputs) -> None:
        for i, tensor in enumerate(inputs):
            self.sink.put(BATCH, arg_name(i), tensor)

    def enter_phase(self, phase: str) -> None:
        """The iteration moves on (forward, backward, probes, parameters, step, writing): tell `progress` at once,
        not only at the next captured tensor (a phase may capture none: the probes, the step)."""
        self.phase = phase
        if self.progress is not None:
            self.progress(phase, self.sink.num_tensors)

    def keep_grads(self) -> None:
        """A backward returned: keep host copies of the parameter gradients as it left them (unscaled), what
        `param_grads` stores unless another backward keeps newer ones. Between the last backward and the step the
        loop may clip or unscale them in place; with several microbatches the last backward is known only when the
        step begins. Costs one host copy of the gradients per backward (the file's copy: it is what is written)."""
        scale = self.module_capture.grad_scale
        self._kept = [(n, host_copy(shard_of(unscaled(p.grad, scale))), shard_attrs(placement_of(p.grad)))
                      for n, p in parameters(self.model) if p.grad is not None]
        if self.probe is not None:
            self.probe.kept_grads = {n: t for n, t, _ in self._kept}

    def param_grads(self, unreduced: bool = False) -> None:
        """Store the parameter gradients (as the last backward left them: `keep_grads`; without a backward, as they
        are); `unreduced`: they were reduced over ranks, and the copies `watch_unreduced` kept of each rank's own
        are stored too (`param_grads_unreduced`)."""
        self.enter_phase("parameters")
        scale = self.module_capture.grad_scale
        kept, self._kept = self._kept, None
        if kept is None:
            kept = [(n, unscaled(p.grad, scale), None) for n, p in parameters(self.model) if p.grad is not None]
        names = []
        for name, grad, attrs in kept:
            self.sink.put(PARAM_GRADS, name, grad, attrs, dedup=False)
            names.append(name)
        self.writer.attrs(PARAM_GRADS, {"order": names})
        # what a change before the step (clipping) is measured against; none for a rank's shards (no total)
        sharded = any(attrs is not None or is_dtensor(grad) for _, grad, attrs in kept)
        self._grad_norms = None if sharded else squared_norms([(n, g) for n, g, _ in kept])
        own, self._unreduced = self._unreduced, None
        self._unwatch()
        if unreduced and own:
            self._named(UNREDUCED_GRADS, [(n, own[n]) for n in names if n in own])

    def state_after(self) -> None:
        self._named(STATE_AFTER, [(name, t) for name, t, _ in state_tensors(self.model)])
        if self.probe is not None:
            self.probe.after_step()

    def microbatch_losses(self, values: list[float]) -> None:
        """Each microbatch's loss (an iteration of several: `/microbatch_loss`, float64, NaN for one without a
        backward)."""
        import torch

        self.sink.put("", MICROBATCH_LOSS, torch.tensor(values, dtype=torch.float64), dedup=False)

    def finish(self, loss, attrs: dict[str, Any] | None = None) -> tuple[int, int]:
        """Write the loss, mark the file complete and close it. Returns (datasets incl. links, tensor bytes)."""
        self.sink.put("", LOSS, loss)
        if self.probe is not None:
            self.writer.local_table(*self.probe.table(self.module_capture.seqs))
        final = {"num_calls": self.module_capture.num_calls, "loss": float(loss.detach().float()), **(attrs or {}),
                 **self.extra_attrs}
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
