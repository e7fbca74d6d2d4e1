"""The fidelity check: a rerun counts only where it reproduces the call as it ran live in the target.

Where this sits: `probe.TeacherForcedProbe` judges each module call by a *rerun* (`rerun.py`) on the reference's
values, and the optimizer's update by a *shadow step* (`optimizer_rows.py`) of a copy of the target's optimizer.
Both are models of what the target computed. Here each is checked against the target's live computation before
its verdict counts:

- **Forward.** When everything the call consumed in the live run (its inputs, and the outputs of the children its
  rerun forces) is bitwise equal to the reference's, the primary rerun *is* the check, at no extra cost: its
  outputs must equal the live outputs. Otherwise the call is rerun once more on the target's own live values (the
  live inputs, the forced children's live outputs: `LiveSource`) and those outputs must equal the live ones.
  Bitwise on a deterministic device (the CPU); elsewhere a mismatch is weighed against the same-precision spread,
  measured there and then by running the same rerun twice (`_beyond_spread`).
- **Backward** (on the CPU). Where everything the call's backward consumed live (the gradients w.r.t. its
  outputs, the input gradients its forced children handed back, and its forward's consumed values) equals the
  reference's bitwise, its live input gradients must equal the primary rerun's up to summation order
  (`BackwardChecks`: sketches kept from the rerun until the live backward has run). Elsewhere the backward is not
  checked: the live gradients of a call whose values differ arrive after its rerun is gone, and sketches cannot
  weigh a device's spread.
- **Optimizer.** The shadow step on the reference's weights and gradients is the check when the live weights and
  gradients equal the reference's bitwise; otherwise the copy is stepped once more from the live ones. After the
  real step, each parameter's live value must equal the checked step's (`optimizer_rows.check_updates`).

A call that fails is not cleared by its rerun: `probe.py` drops its rows and lists it in `/unprobed` with the
reason (`not reproducible from its inputs: ...`), and the judge then holds its live values to what their inputs
explain (`judge/blame.py`), naming it when they are off by more.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from oneiter.format.schema import BACKWARD, FORWARD, ROOT_MODULE, tensor_path
from oneiter.record.capture import CallRecord
from oneiter.record.rerun import ProbeSkip, RunResult, rel_l2
from oneiter.runtime.precision import unit_roundoff

__all__ = ["LiveSource", "check_forward", "exact", "exact_tensor", "digest", "SPREAD_FACTOR", "BackwardChecks"]

# a rerun on a nondeterministic device reproduces the live call when it is within this many times the spread of
# two reruns of the same call
SPREAD_FACTOR = 4.0


class LiveSource:
    """The target's own live values by path, falling back to the probe's source (the reference) for the rest:
    random values and starting states the target replayed from the reference, and values that were exact."""

    def __init__(self, inner, live: dict):
        self.inner, self.live = inner, live

    def has(self, path: str) -> bool:
        return path in self.live or self.inner.has(path)

    def tensor(self, path: str):
        return self.live[path] if path in self.live else self.inner.tensor(path)


def exact(source, path: str, live) -> bool:
    """Whether a live tensor equals the source's tensor at `path` bitwise (dtype and shape included)."""
    return source.has(path) and exact_tensor(source.tensor(path), live)


def exact_tensor(stored, live) -> bool:
    """Whether two tensors are bitwise equal (dtype and shape included), wherever each lives."""
    if stored.dtype != live.dtype or tuple(stored.shape) != tuple(live.shape):
        return False
    a, b = stored.detach().to(live.device), live.detach()
    if a.is_floating_point() or a.is_complex():  # bits, so that a NaN equals the same NaN
        a, b = _bits(a), _bits(b)
    return bool(torch.equal(a, b))


def _bits(tensor):
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.contiguous().view(torch.uint8)


def digest(tensor) -> bytes:
    """A hash of a tensor's bits: bitwise equality of two tensors that are not both at hand."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


def check_forward(rec: CallRecord, primary: RunResult, source, rerun) -> bool:
    """Raise ProbeSkip when the rerun machinery does not reproduce the call's live outputs (module docstring).
    `rerun(source)` reruns the call at the primary site from `source`. Returns whether everything the call
    consumed was bitwise the reference's (the primary rerun was the check)."""
    live_in, live_out = rec.live_inputs or {}, rec.live_outputs or {}
    rec.live_inputs = rec.live_outputs = None
    forced = rec.forced()
    consumed = all(exact(source, tensor_path(rec.key, FORWARD, n), v) for n, v in live_in.items())
    consumed = consumed and all(child.outputs_exact for child in forced)
    rec.outputs_exact = all(exact(source, tensor_path(rec.key, FORWARD, n), v) for n, v in live_out.items())
    if consumed:
        run, again = primary, (lambda: rerun(source))
    else:
        live = {tensor_path(rec.key, FORWARD, n): v for n, v in live_in.items()}
        for child in forced:
            live.update((tensor_path(child.key, FORWARD, n), v) for n, v in (child.kept_outputs or {}).items())
        alive = LiveSource(source, live)
        run, again = rerun(alive), (lambda: rerun(alive))
    differ = _differences(run, live_out)
    if differ and _beyond_spread(run, again, differ, live_out):
        name, err = differ[0]
        what = "the reference's" if consumed else "its own live"
        raise ProbeSkip(f"not reproducible from its inputs: its rerun on {what} values gives {name} off the live "
                        f"call's by rel_l2 {err:.2e} (state, a counter or a layout no rerun carries)")
    if not rec.outputs_exact and rec.parent is not None:  # the caller's check reruns on these
        rec.kept_outputs = {n: v.clone() for n, v in live_out.items()}
    for child in forced:
        child.kept_outputs = None
    return consumed


def _differences(run: RunResult, live_out: dict) -> list[tuple[str, float]]:
    found = []
    for name, value in live_out.items():
        mine = run.forward.get(name)
        if mine is None or (FORWARD, name) in run.passed:
            continue
        if not exact_tensor(mine, value):
            found.append((name, rel_l2(value, mine)))
    return found


def _beyond_spread(run: RunResult, again, differ: list, live_out: dict) -> bool:
    """Whether the differences exceed the device's own run-to-run spread (0 on the CPU: deterministic)."""
    if all(v.device.type == "cpu" for v in live_out.values()):
        return True
    second = again()
    spread = max((rel_l2(run.forward[n], second.forward[n]) for n, _ in differ if n in second.forward),
                 default=0.0)
    return not all(err <= SPREAD_FACTOR * spread for _, err in differ)


class BackwardChecks:
    """The backward half of the check, on the CPU: what each exactly-fed call's live backward must give.

    The live input gradient of a call is read from its own autograd nodes and summed there (`input_grads.py`), the
    rerun's by autograd: where an input feeds several of the call's ops (a residual), the two sum the same terms in
    another order, so they agree to rounding, not bit for bit. Each is kept as a sketch (`sketch`: its norm and its
    projections on a few fixed random vectors), from which the distance of the two is estimated; it must be within
    `ORDER_FACTOR` unit roundoffs of the gradient's norm. A wrong backward kernel is many orders above that."""

    def __init__(self) -> None:
        self.live: dict[str, tuple] = {}  # backward path -> sketch of the live gradient
        self.pending: list[tuple[str, int, dict, dict]] = []
        self.num_checked = 0

    def live_grad(self, key: str, name: str, grad) -> None:
        """A live gradient the capture recorded (`calls/<key>/backward/<name>`)."""
        path = tensor_path(key, BACKWARD, name)
        self.live[path] = sketch(grad, path)

    def expect(self, rec: CallRecord, primary: RunResult, read: dict) -> None:
        """After a call's exactly-fed primary rerun: sketches of the backward values it read from the reference
        (`read`: path -> tensor) and of the input gradients it produced."""
        consumed = {path: sketch(t, path) for path, t in read.items() if path.split("/")[-2] == BACKWARD}
        produced = {}
        for name, value in primary.backward.items():
            if ":" not in name and (BACKWARD, name) not in primary.passed:
                path = tensor_path(rec.key, BACKWARD, name)
                produced[path] = sketch(value, path)
        if consumed and produced:
            self.pending.append((rec.path or ROOT_MODULE, rec.call, consumed, produced))

    def failures(self) -> list[tuple[str, int, str, float]]:
        """(module, call, gradient, relative distance) of each call whose live backward, fed exactly what its
        rerun was, differs by more than summation order does."""
        found = []
        for module, call, consumed, produced in self.pending:
            if any(path not in self.live or self.live[path][0] != s[0] for path, s in consumed.items()):
                continue  # what it consumed live differs (or was not captured): not checked
            self.num_checked += 1
            for path, mine in produced.items():
                live = self.live.get(path)
                distance = _distance(mine, live) if live is not None else 0.0
                if distance > ORDER_FACTOR * mine[3]:
                    found.append((module, call, path.rpartition("/")[2], distance))
                    break
        self.pending, self.live = [], {}
        return found


ORDER_FACTOR = 16.0  # unit roundoffs of relative distance another summation order may give (measured: <= 2)
_PROJECTIONS = 4


def sketch(tensor, path: str) -> tuple:
    """(digest, norm, projections, unit roundoff) of a tensor: enough to tell bitwise equality (the digest) and
    estimate the distance of two tensors of the same path (projections on `_PROJECTIONS` random Gaussian vectors
    seeded by the path: each projection of a difference has the difference's norm as its standard deviation)."""
    flat = tensor.detach().to("cpu").reshape(-1)
    values = flat.to(torch.float64).numpy()
    # numpy's generator: a torch random op here (a gradient hook of the live backward) would be taken for one of
    # the model's by the random-op replay
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little"))
    projections = [float(values @ rng.standard_normal(values.size)) for _ in range(_PROJECTIONS)]
    roundoff = unit_roundoff(str(tensor.dtype).removeprefix("torch.")) if tensor.is_floating_point() else 0.0
    return digest(flat), float(np.linalg.norm(values)), projections, roundoff


def _distance(a: tuple, b: tuple) -> float:
    """The estimated relative distance ||a - b|| / ||a|| of two sketched tensors (0 when bitwise equal)."""
    if a[0] == b[0]:
        return 0.0
    spread = (sum((x - y) ** 2 for x, y in zip(a[2], b[2], strict=True)) / len(a[2])) ** 0.5
    return spread / a[1] if a[1] else float("inf")
