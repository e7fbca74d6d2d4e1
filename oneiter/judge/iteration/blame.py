"""Blame: the module call whose *own* computation is wrong, what drift nothing explains, and where NaN/Inf appear.

Sits after the engine's accumulated rows. A target differs from the reference a little in every layer (bf16
kernels, other accumulation orders), so accumulated error grows with depth and the first entry over a fixed
tolerance is usually not the broken layer. Recordings made with local data (`record --replay`, teacher forced;
`record --against cpu`) hold a `/local` table (see `record/local/probe.py`): for every module call — leaves,
containers and the model itself — the error of what its own code produced on trustworthy inputs, free of
upstream drift, and the calibrated noise its precision explains.

A local row is *flagged* when its rel-L2 error exceeds `factor` times its expected noise, where the expected
noise is the larger of
- the calibrated noise (`noise_target + noise_reference`: the same code run in the run's precision and in the
  reference's precision, each against float64 — so a difference in the code itself is never part of it), and
- a floor of `floor_ulps` unit roundoffs of the tensor's dtype (2^-24 for float32, 2^-8 for bfloat16, ...);
or when NaN/Inf sit at other positions (or with another sign) than in its reference.

**A noise estimate is itself checked.** Where the probe measured what the precision can produce for the call on
the trusted path (`noise_bound`: `record/local/probe.py`), a calibrated noise more than `NOISE_BOUND_FACTOR` (16)
times that bound (and the floor) is no noise: the row's calibration is *not trusted* (`LocalResult.untrusted`), its
expected noise is the bound's, and it is never cleared by the noise it claimed: flagged when its error exceeds
`factor` times the bound, else a `calibration` finding of its own (`findings.py`: the verdict is then no match).
The **culprit** is the first flagged row in causal order: forward as executed, then backward as computed. Its
**chain** lists the calls that contain it, innermost first.

**Unattributed divergence.** Probes cannot see everything (a call that could not be rerun, the loss function
outside the model, the optimizer). So when no row is flagged, the entries no probe covers are checked against
what the precision explains: parameter gradients, updated parameters and buffers, the loss, the gradient
entering the model from the loss, and the outputs of unprobed calls. Each may differ by at most `factor` times
the largest accumulated error of what it was computed from (its call's inputs and output gradients, its
gradient; the dtype's floor at least), and, when both runs used the same precision, must also be outside the
dtype's tolerance. One that is not explained makes the run diverge with basis `unattributed`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from oneiter.format.layout import IterationFile
from oneiter.format.schema import BACKWARD, FORWARD, ROOT_MODULE, LocalRow, is_input
from oneiter.judge.iteration.entries import Key, LocalMetrics, LocalResult
from oneiter.judge.iteration.findings import Finding
from oneiter.judge.iteration.summed import inherited, readers_gradients
from oneiter.judge.measure.tolerance import NoisePolicy
from oneiter.runtime.precision import UNIT_ROUNDOFF, amp_dtype_name, expected_noise, unit_roundoff

__all__ = ["UNIT_ROUNDOFF", "ROUNDING_NOISE", "local_results", "find_culprit", "culprit_chain",
           "nan_origin", "unexplained_rows", "loss_unexplained", "own_values", "Sources", "PHASE_ORDER"]

PHASE_ORDER = {"forward": 0, "backward": 1, "param_grad": 2, "optimizer": 3}
# an expected noise (relative to float64) this large says the value is rounding itself: its precision's own error is
# as large as the value, which is 0 (or far below what it was computed from) in exact arithmetic
ROUNDING_NOISE = 1.0


def local_results(tgt: IterationFile, noise: NoisePolicy) -> list[LocalResult]:
    """Every row of the target's `/local` table, judged, in causal order."""
    run = amp_dtype_name(tgt.meta.get("amp")) or str(tgt.meta.get("dtype") or "float32")
    results = [_judge(row, noise, run) for row in tgt.local_rows()]
    results.sort(key=lambda r: (PHASE_ORDER.get(r.phase, 9), r.seq))
    return results


def _judge(row: LocalRow, noise: NoisePolicy, run_dtype: str) -> LocalResult:
    metrics = LocalMetrics(num_elements=row.numel, rel_l2=row.rel_l2, max_abs=row.max_abs, cosine=row.cosine,
                           num_nan_ref=row.nan_ref, num_inf_ref=row.inf_ref, num_nan_target=row.nan,
                           num_inf_target=row.inf, num_mismatch=row.mismatch)
    # not calibrated (NaN: within one unit roundoff of the tensor's dtype and of the run's compute precision, bf16
    # under --amp bf16), or calibrated far above what the precision can produce: `precision.expected_noise`
    calibrated, expected, bound = expected_noise(row.noise_target, row.noise_reference, row.noise_bound,
                                                 noise.floor(row.dtype), noise.floor(run_dtype))
    if row.recipe:
        return _judge_recipe(row, noise, metrics, calibrated)
    factor = noise.factor_for(row.module)
    error = row.rel_l2 if not math.isnan(row.rel_l2) else math.inf
    flagged = not noise.skipped(row.module) and (error > factor * expected or row.mismatch > 0)
    return LocalResult(**Key(*row.key)._asdict(), dtype=row.dtype, seq=row.seq, metrics=metrics, calibrated=calibrated,
                       calibration=row.calibration, expected=expected, factor=factor, flagged=flagged, bound=bound,
                       rounding=not flagged and expected >= ROUNDING_NOISE)


def _judge_recipe(row: LocalRow, noise: NoisePolicy, metrics: LocalMetrics, calibrated: Optional[float]
                  ) -> LocalResult:
    """A call that runs a low-precision recipe (`record/local/recipe_rows.py`): its deviation from the recipe's exact
    emulation, against the accumulation's noise; never below one unit roundoff of the recipe's accumulator
    (float32): a correct kernel's result lies within the emulation's rounding interval, whatever the tensor's dtype.
    The format's own cost (rel_l2 against the reference) is reported, never judged."""
    expected = max(calibrated if calibrated is not None else 0.0, noise.floor("float32"))
    factor = noise.factor_for(row.module)
    error = row.recipe_rel_l2 if not math.isnan(row.recipe_rel_l2) else math.inf
    flagged = not noise.skipped(row.module) and (error > factor * expected or row.mismatch > 0)
    return LocalResult(**Key(*row.key)._asdict(), dtype=row.dtype, seq=row.seq, metrics=metrics, calibrated=calibrated,
                       calibration=row.calibration, expected=expected, factor=factor, flagged=flagged,
                       recipe=row.recipe, recipe_rel_l2=row.recipe_rel_l2, format_cost=row.format_cost)


def find_culprit(results: list[LocalResult]) -> Optional[LocalResult]:
    """The first flagged row in causal order (results are already ordered)."""
    return next((r for r in results if r.flagged), None)


def culprit_chain(culprit: LocalResult, parents: dict[tuple[str, int], tuple[str, int] | None],
                  results: list[LocalResult]) -> list[dict[str, Any]]:
    """The culprit's call, then every call containing it up to the model, with their own local verdict."""
    worst: dict[tuple[str, int], LocalResult] = {}
    for r in results:
        key = (r.module, r.call)
        if key not in worst or r.ratio > worst[key].ratio:
            worst[key] = r
    chain, seen = [], set()
    at: Optional[tuple[str, int]] = (culprit.module, culprit.call)
    while at is not None and at not in seen:
        seen.add(at)
        mine = worst.get(at)
        chain.append({"module": at[0], "call": at[1], "flagged": bool(mine and any(
            r.flagged for r in results if (r.module, r.call) == at)), "max_ratio": mine.ratio if mine else None})
        at = parents.get(at)
    return chain


def nan_origin(counts: dict[tuple[str, int, str, str], int], order: list[tuple[str, int, str, str]]) -> Optional[dict]:
    """The first module call whose outputs hold NaN/Inf while its inputs do not.

    `counts` maps entry keys to the target's number of non-finite elements, `order` lists the keys in causal
    order. Forward: outputs vs inputs of a call; backward: grad_input vs grad_output of a call.
    """
    inputs: dict[tuple[str, int, str], int] = {}
    for key in order:
        module, call, phase, tensor = key
        if phase in (FORWARD, BACKWARD) and key in counts and is_input(tensor):
            inputs[(module, call, phase)] = inputs.get((module, call, phase), 0) + counts[key]
    for key in order:  # the first non-finite *output* in causal order whose call had finite inputs
        module, call, phase, tensor = key
        if phase in (FORWARD, BACKWARD) and counts.get(key) and not is_input(tensor):
            if not inputs.get((module, call, phase)):
                return {"module": module, "call": call, "phase": phase, "tensor": tensor}
    return None


# -- unattributed divergence ----------------------------------------------------------------------------------------
# Accumulated errors no rounding drift produces from inputs that are close (below 1/factor), per phase. Measured on
# the clean bf16/fp16 runs of the test models (tiny shapes: BatchNorm over 2x512x1x1): backward gradients reach
# rel_l2 70 with a cosine of -0.07 (BatchNorm's backward amplifies), so backward tensors get no such rule; a forward
# output 10x off, a parameter gradient pointing the other way, or an updated weight as far from the reference's as
# it is large, are no drift. Buffers (BatchNorm's running mean, near zero) are not held to it.
GROSS = {"forward": (10.0, 1.0), "param_grad": (1.5, -0.9), "optimizer": (1.0, 1.0)}  # phase: (rel_l2 >=, cosine <=)


def _gross(r) -> bool:
    limit = GROSS.get(r.phase)
    return limit is not None and r.metrics.rel_l2 >= limit[0] and r.metrics.cosine <= limit[1]


class Sources:
    """The engine's accumulated errors, indexed by entry and by call: the largest error of what an entry was
    computed from, and whether all of it is bitwise the reference's (`exact_*`).

    What a call's own code computes from, in a phase (what its teacher-forced rerun is fed): forward, its inputs
    and its children's outputs; backward, the same plus its output gradients and its children's input gradients.
    An entry is *exact* when it was measured and is bitwise equal (rel_l2 and max_abs 0, NaN/Inf where the
    reference has them); sources are exact only when every one is known and exact (a call with no recorded input,
    or a child with no recorded output, is not). A collective a call's own code ran is one more thing it computed
    from (`consumed`: ((module, call, phase), key, error, bitwise) per collective output, from
    `judge/iteration/collective_verdict.consumed`).

    A gradient of a tensor several calls read is the sum of what each hands back (`summed.py`): with `stored` (each
    row's stored datasets, `CompareResult.stored`) the readers are known, and with `norm` (a key's reference L2 norm)
    what the sum inherits from them is bounded in absolute terms, each term at least at `run_dtype`'s rounding.
    `stepped_changed`: a step saw gradients changed after backward (clipping: `/step_grads`), so an update is no
    longer computed from its recorded gradient alone."""

    def __init__(self, rows: list, loss: dict[str, Optional[float]], parents: Optional[dict] = None,
                 consumed: tuple = (), *, stored: Optional[list] = None,
                 norm: Optional[Callable[[tuple], Optional[float]]] = None, run_dtype: str = "",
                 stepped_changed: bool = False):
        self.stepped_changed = stepped_changed
        self.errors = {r.key: r.metrics.rel_l2 for r in rows if r.metrics is not None}
        self.summands = readers_gradients(rows, stored, parents or {}) if stored is not None else {}
        self.norm, self.run_roundoff = norm, unit_roundoff(run_dtype) if run_dtype else 0.0
        self.by_call: dict[tuple[str, int, str], list[float]] = {}
        self.keys: dict[tuple[str, int, str], list[tuple]] = {}
        for (module, call, phase, tensor), err in self.errors.items():
            kind = "in" if is_input(tensor) else "out"
            self.by_call.setdefault((module, call, f"{phase}.{kind}"), []).append(err)
            self.keys.setdefault((module, call, f"{phase}.{kind}"), []).append((module, call, phase, tensor))
        self.bitwise = {r.key for r in rows if r.metrics is not None
                      and r.status in ("match", "diverged") and _bitwise(r.metrics)}
        for (module, call, phase), key, err, bitwise in consumed:
            self.by_call.setdefault((module, call, f"{phase}.in"), []).append(err)
            self.keys.setdefault((module, call, f"{phase}.in"), []).append(key)
            if bitwise:
                self.bitwise.add(key)
        self.children: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for child, parent in (parents or {}).items():
            if parent is not None:
                self.children.setdefault(parent, []).append(child)
        self.calls_of: dict[str, list[int]] = {}
        for module, call in {(m, c) for m, c, _ in self.by_call}:
            self.calls_of.setdefault(module, []).append(call)
        self.all_exact = bool(self.errors) and all(
            k in self.bitwise for k in self.errors if k[2] in (FORWARD, BACKWARD))
        self.everything = max(self.errors.values(), default=0.0)
        self.root_out = max(self.by_call.get((ROOT_MODULE, 0, "forward.out"), [0.0]))
        self.loss_err = _scalar_error(loss)
        # the largest error of the backward entries computed before each gradient the model's outputs received: an
        # output the model also consumed itself (BART's encoder_last_hidden_state, which every decoder layer's
        # cross-attention reads) has a gradient summed from those consumers, computed after their backward
        self.backward_before: dict[tuple, float] = {}
        running = 0.0
        for r in rows:
            if r.phase != BACKWARD or r.metrics is None:
                continue
            if r.module == ROOT_MODULE and r.tensor.startswith("grad_output"):
                self.backward_before[r.key] = running
            running = max(running, r.metrics.rel_l2) if not math.isnan(r.metrics.rel_l2) else running

    def exact_call(self, module: str, call: int, phase: str) -> bool:
        """Whether everything a call's own code computed from in `phase` is known and bitwise the reference's."""
        own = ("forward.in",) if phase == FORWARD else ("forward.in", "backward.in")
        theirs = ("forward.out",) if phase == FORWARD else ("forward.out", "backward.out")
        keys = [k for kind in own for k in self.keys.get((module, call, kind), [])]
        if not keys:
            return False
        for child in self.children.get((module, call), []):
            found = [k for kind in theirs for k in self.keys.get((*child, kind), [])]
            if not found:
                return False
            keys += found
        return all(k in self.bitwise for k in keys)

    def exact_local(self, r: LocalResult, world_size: int = 1) -> bool:
        """Whether everything the local row's value was computed from is bitwise the reference's: its call's
        sources (forward, backward); for a parameter gradient (summed over every call that used it, shared weights
        included) every recorded forward and backward entry; for an update, its exact gradient (a buffer: its
        module's forward sources). Gradients averaged over ranks are no rank's own: never exact there."""
        if r.phase in (FORWARD, BACKWARD):
            return self.exact_call(r.module, r.call, r.phase)
        if world_size > 1:
            return False
        if r.phase == "param_grad":
            return self.all_exact
        grad = r.key.param_grad
        if grad in self.errors:
            return grad in self.bitwise and not self.stepped_changed
        calls = self.calls_of.get(r.module, [])
        return bool(calls) and all(self.exact_call(r.module, c, FORWARD) for c in calls)

    def _module_errors(self, module: str, kinds: tuple[str, ...]) -> list[float]:
        """The errors of every call of `module` of the given kinds (`forward.in`, ...), in index order."""
        return [e for (m, _c, k), es in self.by_call.items() if m == module and k in kinds for e in es]

    def _call_inputs(self, r) -> float:
        """The largest error of the entry's call's inputs (and, in backward, its output gradients)."""
        kinds = ("forward.in",) if r.phase == FORWARD else ("backward.in", "forward.in")
        return max((e for k in kinds for e in self.by_call.get((r.module, r.call, k), [])), default=0.0)

    def upstream(self, r, unprobed: set[tuple[str, int]], covered: set[Key]) -> Optional[float]:
        """The error the entry may inherit, or None when a probe (or a local row) covers it."""
        if r.key in covered:
            return None
        if r.phase == "param_grad":
            sources = self._module_errors(r.module, ("forward.in", "backward.in"))
            return max(sources) if sources else self.everything
        if r.phase == "optimizer":
            grad = self.errors.get(r.key.param_grad)
            if grad is not None:
                return grad
            sources = self._module_errors(r.module, ("forward.in",))
            return max(sources) if sources else self.everything
        if r.module == ROOT_MODULE and r.phase == BACKWARD and r.tensor.startswith("grad_output"):
            # from the loss (computed from the outputs), and from whatever the model's own backward summed into it:
            # the gradients its readers handed back (`summed.py`), else every backward entry before it
            before = self.backward_before.get(r.key, 0.0)
            return max(self.root_out, self.loss_err or 0.0, before, self.summed(r.key, r.dtype_target or r.dtype))
        if (r.module, r.call) in unprobed and not is_input(r.tensor):
            return self._call_inputs(r)
        return None  # covered by a probe

    def summed(self, key: Key, dtype: Optional[str] = None) -> float:
        """What the gradient `key` inherits from the readers' gradients it is the sum of (0.0: no readers known)."""
        terms = self.summands.get(key)
        if not terms:
            return 0.0
        floor = max(self.run_roundoff, unit_roundoff(dtype) if dtype else 0.0)
        return inherited(terms, key, self.errors, floor, self.norm)

    def exact(self, r, unprobed: set[tuple[str, int]], covered: set[Key]) -> bool:
        """Whether everything an entry no probe covers was computed from is known and bitwise equal to the
        reference's (an update from exact gradients; an unprobed call's output from exact inputs)."""
        if r.key in covered:
            return False
        if r.phase == "optimizer":
            return r.key.param_grad in self.bitwise and not self.stepped_changed
        if r.phase == "param_grad":  # summed over every call that used it (shared weights too): every entry
            return self.all_exact
        if (r.module, r.call) in unprobed and not is_input(r.tensor):
            return self.exact_call(r.module, r.call, r.phase)
        return False

    def inputs(self, r) -> float:
        """The largest error of what the entry was computed from (its call's inputs; a gradient's, too)."""
        if r.phase == "optimizer":
            grad = self.errors.get(r.key.param_grad, 0.0)
            return max(grad, *self.by_call.get((r.module, 0, "forward.in"), [0.0]))
        if r.phase == "param_grad":
            return max(self._module_errors(r.module, ("forward.in", "backward.in")), default=0.0)
        return self._call_inputs(r)


def unexplained_rows(rows: list, unprobed: set[tuple[str, int]], noise: NoisePolicy, *, same_precision: bool,
                     loss: dict[str, Optional[float]], covered: set[Key], amp: str = "",
                     sources: Optional[Sources] = None, rounding: frozenset[int] | set[int] = frozenset()
                     ) -> list[Finding]:
    """An `unexplained` finding (row index, why) for every entry no probe covers whose difference the precision
    does not explain, in causal order.

    `rows` are the engine's accumulated rows in causal order; `unprobed` the (module, call)s whose probe failed
    (or that had nothing of their own to judge); `covered` the keys of parameter-gradient and optimizer entries
    that have a local row of their own; `sources` the rows indexed with the call tree (built here without one);
    `rounding` the rows known to be their call's own rounding (the same tensor as a local row that is: another
    name of it is no other value).
    """
    upstream = sources or Sources(rows, loss)
    found = []
    for i, r in enumerate(rows):
        if r.metrics is None or r.status not in ("match", "diverged") or i in rounding:
            continue  # missing/shape/dtype rows are judged as structural divergences
        exact = upstream.exact(r, unprobed, covered)
        if same_precision and r.status != "diverged" and not exact:
            continue  # the same precision on both sides: within the dtype's tolerance is explained, unless nothing
            # it was computed from differs (then only its own rounding is, below)
        finding = _gross_finding(i, r, upstream, noise)
        if finding is None:
            finding = _drift_finding(i, r, upstream.upstream(r, unprobed, covered), noise, amp, exact)
        if finding is not None:
            found.append(finding)
    return found


# How closely a value computed from exact sources must agree with its own rerun, in units of the run's roundoff:
# on the CPU the fidelity check held the rerun to the live call bitwise (what is left is the two metrics' own
# float64 arithmetic); elsewhere within 4x the rerun-to-rerun spread, which nondeterministic kernels give.
AGREE_ULPS = {"cpu": 4.0, "device": 64.0}
AGREE_REL = 0.01  # and in any case within 1 % of the larger error


def own_values(rows: list, local: list[LocalResult], sources: Sources, *, on_cpu: bool, run_dtype: str,
               world_size: int = 1, update_scale: Optional[Callable[[str, str], float]] = None
               ) -> tuple[list[Finding], set[int]]:
    """Entries computed from values all bitwise the reference's: their accumulated error *is* their own code's
    error, so it must agree with their local row (`Sources.exact_local`). One that does not is an `unexplained`
    finding, whichever way: the value is not what its code computes from those values (a gradient scaled after
    backward, a wrong accumulation), or its local row claims an error the value does not have (a damaged or
    forged file). Returns the findings and the rows that agree and are outside tolerance: their own rounding,
    never accumulated drift (`verdict.settled_rows` labels them `rounding`). Flagged rows are the culprit's
    business and left alone.

    A parameter's update row measures the update (after - before, relative to the reference's update), its entry
    the updated value (relative to the updated value): `update_scale(module, tensor)` gives ||after|| / ||update||
    of the reference, which turns one into the other (read only where the updated value is not bitwise the
    reference's; without it, those are not checked)."""
    index = {r.key: i for i, r in enumerate(rows)}
    found, rounding = [], set()
    ulps = AGREE_ULPS["cpu" if on_cpu else "device"]
    for lr in local:
        i = index.get(lr.row_key)
        if lr.flagged or i is None or rows[i].metrics is None or rows[i].status not in ("match", "diverged"):
            continue
        if not sources.exact_local(lr, world_size):
            continue
        acc, own, what = rows[i].metrics.rel_l2, lr.rel_l2, "rel_l2"
        floor = max(unit_roundoff(lr.dtype), unit_roundoff(run_dtype))
        if lr.phase == "optimizer" and lr.key.param_grad in sources.errors and acc > 0:
            if update_scale is None:
                continue
            scale = update_scale(lr.module, lr.tensor)  # ||after|| / ||update||: the updated value's rounding too
            acc, floor, what = acc * scale, floor * max(scale, 1.0), "rel_l2 of its update"
        limit = max(AGREE_REL * max(acc, own), ulps * floor)
        if abs(acc - own) <= limit:  # NaN on either side is no agreement
            if rows[i].status == "diverged":
                rounding.add(i)
            continue
        if acc > own:
            why = (f"{what} {acc:.2e}, although everything it was computed from is bitwise the reference's and "
                   f"its own code, rerun on those values, differs by only {own:.2e}: the value is not what its "
                   f"code computes")
        else:
            why = (f"{what} {acc:.2e}, from values all bitwise the reference's, yet its local row claims its own "
                   f"code differs by {own:.2e}: the file contradicts itself")
        found.append(Finding.of("unexplained", i, why))
    return found, rounding


def _bitwise(m) -> bool:
    """Measured bitwise equal: no difference at all (NaN/Inf where the reference has them)."""
    return m.rel_l2 == 0 and m.max_abs == 0 and not m.nonfinite_differs


def _gross_finding(i: int, r, upstream: Sources, noise: NoisePolicy) -> Optional[Finding]:
    """An `unexplained` finding for a diverged entry far off (see GROSS) from inputs that are close: no rounding
    drift does this, whatever the local rows say (they cover each call's own code; this value did not come out
    of it)."""
    trained = r.phase != "optimizer" or r.key.param_grad in upstream.errors  # not a buffer
    if not (r.status == "diverged" and trained and _gross(r) and not is_input(r.tensor)):
        return None
    source = upstream.inputs(r)
    if not source * noise.factor_for(r.module) < 1.0:  # not `>=`: a NaN source explains nothing either way
        return None
    return Finding.of("unexplained", i, f"rel_l2 {r.metrics.rel_l2:.2e} (cosine {r.metrics.cosine:.2f}): far "
                      f"beyond what it was computed from (within {source:.2e}) and what rounding drift does")


def _drift_finding(i: int, r, up: Optional[float], noise: NoisePolicy, amp: str,
                   exact: bool = False) -> Optional[Finding]:
    """An `unexplained` finding when the entry differs by more than `factor` times the error it inherits (`up`;
    None: a probe covers it) or its precision's floor; outside tolerance at all when everything it was computed
    from is bitwise the reference's (`exact`)."""
    if up is None:
        return None
    if exact and r.status == "diverged":  # nothing it was computed from differs: no drift makes this
        return Finding.of("unexplained", i, f"rel_l2 {r.metrics.rel_l2:.2e}, although everything it was computed "
                          "from is bitwise equal to the reference's (so no accumulated drift)")
    dtype = r.dtype_target or r.dtype or "float32"
    # the run's precision sets the floor: under bf16 autocast a float32 tensor is not held to float32 rounding
    floor = max(noise.floor(dtype), noise.floor(amp) if amp else 0.0)
    bound = noise.factor_for(r.module) * max(up, floor)
    if not r.metrics.rel_l2 > bound:  # not `<=`: a NaN error is not flagged here
        return None
    return Finding.of("unexplained", i, f"rel_l2 {r.metrics.rel_l2:.2e} is more than "
                      f"{noise.factor_for(r.module):g}x what it was computed from ({up:.2e}) or the "
                      f"precision's floor ({floor:.1e}) explain")


def loss_unexplained(loss: dict[str, Optional[float]], rows: list, noise: NoisePolicy,
                     same_precision: bool, dtype: str) -> list[Finding]:
    """A `loss` finding when the loss differs more than the model's outputs explain (none when it does not)."""
    err = _scalar_error(loss)
    if err is None:
        return []
    outs = [r.metrics.rel_l2 for r in _model_outputs(rows)]
    bound = noise.factor * max(max(outs, default=0.0), noise.floor(dtype))
    tolerance = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"]) * 16
    if err > bound and (not same_precision or err > tolerance):
        return [Finding.of("loss", None, f"the loss differs by {err:.2e} (relative), more than the model's outputs "
                                         f"explain ({bound:.2e}); code outside the model's forward (the loss "
                                         f"function) is not probed")]
    return []


def _model_outputs(rows: list) -> list:
    """The rows of the model's outputs: its own call's (`(root)`), or, when the model itself was never called (a
    Lightning `training_step` calls its submodules, `self.encoder(x)`), those of the outermost calls it made."""
    outputs = [r for r in rows if r.metrics is not None and r.phase == FORWARD and not is_input(r.tensor)]
    root = [r for r in outputs if r.module == ROOT_MODULE]
    if root:
        return root
    modules = {r.module for r in outputs}
    return [r for r in outputs if not any(r.module.startswith(m + ".") for m in modules)]


def _scalar_error(loss: dict[str, Optional[float]]) -> Optional[float]:
    a, b = loss.get("reference"), loss.get("target")
    if a is None or b is None:
        return None
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / abs(a) if a else math.inf
