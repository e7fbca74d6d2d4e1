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
  (`BackwardChecks`: fingerprints and distances kept from the rerun until the live backward has run). Elsewhere
  the backward is not checked: the live gradients of a call whose values differ arrive after its rerun is gone, and
  a fingerprint cannot weigh a device's spread.
- **Optimizer.** The shadow step on the reference's weights and gradients is the check when the live weights and
  gradients equal the reference's bitwise; otherwise the copy is stepped once more from the live ones. After the
  real step, each parameter's live value must equal the checked step's (`optimizer_rows.check_updates`).

A call that fails is not cleared by its rerun: `probe.py` drops its rows and lists it in `/unprobed` with the
reason (`not reproducible from its inputs: ...`), and the judge then holds its live values to what their inputs
explain (`judge/iteration/blame.py`), naming it when they are off by more.
"""

from __future__ import annotations

import hashlib

import torch

from oneiter.format.schema import BACKWARD, COLLECTIVES, FORWARD, ROOT_MODULE, tensor_path
from oneiter.record.capture.hooks import CallRecord
from oneiter.record.local.rerun import ProbeSkip, RunResult, rel_l2
from oneiter.runtime.precision import unit_roundoff
from oneiter.runtime.sharding import shard_of

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

    def attrs(self, path: str) -> dict:
        attrs = getattr(self.inner, "attrs", None)
        return attrs(path) if callable(attrs) else {}


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


def digest(tensor) -> tuple:
    """A fingerprint of a tensor's bits, to tell bitwise equality of two tensors that are not both at hand: its
    dtype, shape, and two wrapping integer sums of its bits (plain and squared), reduced where the tensor lives.
    Two tensors that differ by rounding somewhere differ in these sums but for a coincidence of both."""
    t = tensor.detach()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if bits is None or t.is_complex():
        flat = t.to("cpu").contiguous().reshape(-1)
        return str(t.dtype), tuple(t.shape), hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes()).digest()
    v = t.contiguous().reshape(-1).view(bits)
    # the squares wrap in the bits' own width: a mix that catches +1 ulp here and -1 ulp there, which the plain
    # sum does not
    return str(t.dtype), tuple(t.shape), int(v.sum(dtype=torch.int64)), int((v * v).sum(dtype=torch.int64))


def check_forward(rec: CallRecord, primary: RunResult, source, rerun) -> bool:
    """Raise ProbeSkip when the rerun machinery does not reproduce the call's live outputs (module docstring).
    `rerun(source)` reruns the call at the primary site from `source`. Returns whether everything the call
    consumed was bitwise the reference's (the primary rerun was the check)."""
    live_in, live_out = rec.live_inputs or {}, rec.live_outputs or {}
    rec.live_inputs = rec.live_outputs = None
    forced = rec.forced()
    consumed = all(exact(source, tensor_path(rec.key, FORWARD, n), v) for n, v in live_in.items())
    consumed = consumed and all(child.outputs_exact for child in forced)
    # a collective the call ran is an input of its own code, as a forced child's output is (its rerun gets the
    # source's result): `record/modes/collectives.py`
    consumed = consumed and all(exact(source, path, v) for path, v in rec.live_collectives.items())
    rec.outputs_exact = all(exact(source, tensor_path(rec.key, FORWARD, n), v) for n, v in live_out.items())
    if consumed:
        run, again = primary, (lambda: rerun(source))
    else:
        live = {tensor_path(rec.key, FORWARD, n): v for n, v in live_in.items()}
        live.update(rec.live_collectives)
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
        if mine is None or (FORWARD, name) in run.passed_on:
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
    another order, so they agree to rounding, not bit for bit. So when the live gradient is not bitwise the rerun's,
    its distance to the reference's (read then) may exceed the rerun's by at most `ORDER_FACTOR` unit roundoffs;
    a wrong backward kernel is orders of magnitude above that. `reference(path)` reads the reference's tensor."""

    def __init__(self, reference) -> None:
        self.reference = reference
        self.live: dict[str, tuple] = {}  # backward path -> fingerprint of the live gradient
        self.live_rel: dict[str, float] = {}  # backward path -> rel_l2 of the live gradient to the reference's
        self.produced: dict[str, tuple] = {}  # backward path -> (fingerprint, rel_l2 to the reference, roundoff)
        self._seen: dict[str, tuple] = {}  # backward path -> fingerprint of the reference's tensor
        self.pending: list[tuple[str, int, dict, list]] = []
        self.num_checked = 0

    def live_grad(self, key: str, name: str, grad) -> None:
        """A live gradient the capture recorded (`calls/<key>/backward/<name>`)."""
        self.live_tensor(tensor_path(key, BACKWARD, name), grad)

    def live_tensor(self, path: str, grad) -> None:
        """A live value a call's backward consumes or produces, by path (a gradient, a collective's output)."""
        grad = shard_of(grad)  # a DTensor gradient: this rank's shard, as the recording stores it
        mine = self.live[path] = digest(grad)
        expected = self.produced.get(path)
        if expected is not None and expected[0] != mine:
            self.live_rel[path] = rel_l2(self.reference(path), grad)

    def expect(self, rec: CallRecord, primary: RunResult, read: dict, reference) -> None:
        """After a call's exactly-fed primary rerun: fingerprints of the backward values it read from the reference
        (`read`: path -> tensor) and of the input gradients it produced, with their distance to the reference's
        (`reference(path)`: the probe's cached read, which judging the rows needs anyway)."""
        consumed = {}
        for path, t in read.items():
            # a reference tensor: the same for every call that reads it; a collective's output is consumed as a
            # gradient is (its live value's fingerprint comes from the recorder)
            if path.split("/")[-2] == BACKWARD or path.startswith(COLLECTIVES + "/"):
                consumed[path] = self._seen[path] if path in self._seen else self._seen.setdefault(path, digest(t))
        produced = []
        for name, value in primary.backward.items():
            path = tensor_path(rec.key, BACKWARD, name)
            if ":" in name or (BACKWARD, name) in primary.passed_on or reference(path) is None:
                continue
            roundoff = unit_roundoff(str(value.dtype).removeprefix("torch.")) if value.is_floating_point() else 0.0
            self.produced[path] = (digest(value), rel_l2(reference(path), value), roundoff)
            produced.append(path)
        if consumed and produced:
            self.pending.append((rec.path or ROOT_MODULE, rec.call, consumed, produced))

    def forget(self, module: str, call: int) -> None:
        """Check nothing more of that call's backward (its rows were dropped for another reason)."""
        self.pending = [p for p in self.pending if (p[0], p[1]) != (module, call)]

    def failures(self) -> list[tuple[str, int, str, float]]:
        """(module, call, gradient, excess distance) of each call whose live backward, fed exactly what its rerun
        was, differs from the rerun's by more than summation order does."""
        found = []
        for module, call, consumed, produced in self.pending:
            if any(self.live.get(path) != d for path, d in consumed.items()):
                continue  # what it consumed live differs (or was not captured): not checked
            self.num_checked += 1
            for path in produced:
                fingerprint, rerun_rel, roundoff = self.produced[path]
                excess = self.live_rel.get(path, rerun_rel) - rerun_rel
                if self.live.get(path, fingerprint) != fingerprint and excess > ORDER_FACTOR * roundoff:
                    found.append((module, call, path.rpartition("/")[2], excess))
                    break
        self.pending, self.live, self.live_rel, self.produced, self._seen = [], {}, {}, {}, {}
        return found


ORDER_FACTOR = 16.0  # unit roundoffs of relative distance another summation order may add
