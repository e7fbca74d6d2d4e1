"""The sentences a verdict is stated in, each made from plain values (an entry's dict, a call's `LocalResult`, the
`Impact` ranking, what each side compiled or ran in a reduced precision), so a verdict decided now and one rebuilt
from a saved JSON report read the same.

Below `statement.py` (which puts them together into a `Verdict`'s headline and details: `render`) and `verdict.py`
(which decides what they say): how every report names an entry (`entry_name`), why a call is blamed
(`culprit_reason`), why its calibration is not trusted (`calibration_reason`), why a row is rounding
(`rounding_reason`), an entry's numbers, and the lines about compiled blocks, reduced precision, untrusted
calibrations and the impact ranking.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from oneiter.format.schema import CLIP_ROW, ROOT_MODULE
from oneiter.formatting import num, sci
from oneiter.judge.iteration.entries import LocalResult
from oneiter.judge.iteration.impact import Impact
from oneiter.judge.iteration.recipe_costs import recipe_error
from oneiter.runtime.compiled import random_lines
from oneiter.runtime.precision_modes import describe, reduced

__all__ = ["entry_name", "STATS_REASON", "ROUNDING_VALUE", "rounding_reason", "culprit_reason", "calibration_reason",
           "own_error", "numbers", "nonfinite_differs", "first_divergence_line", "compiled_lines", "precision_lines",
           "untrusted_lines", "first_fix", "impact_lines", "ranking_lines"]


def entry_name(item: dict) -> str:
    """`layer1.0.conv1@0 forward output`: how every report names an entry (or a culprit, or the NaN/Inf origin); in an
    iteration of several microbatches, with its call's: `layers.0.mlp@1 forward output (microbatch 1)`."""
    name = f"{item.get('module')}@{item.get('call')} {item.get('phase')} {item.get('tensor')}"
    micro = item.get("microbatch")
    return name if micro is None else f"{name} (microbatch {micro})"


STATS_REASON = "from statistics"  # how the engine starts the reason of an entry judged from `--level stats` data


ROUNDING_VALUE = "its value is rounding"  # how the reason of a row that is rounding itself starts (`rounding_reason`)


SENSITIVITY_SAID = 0.05  # a rounding moving the impact ranking's gap by more than this share of it: said


def rounding_reason(local: LocalResult) -> str:
    """Why a row whose value its precision cannot resolve is rounding (`LocalResult.rounding`), with its figures."""
    return (f"{ROUNDING_VALUE}: its precision's own error for it, {sci(local.expected)} relative to float64, is as "
            f"large as the value (0, or far below what it was computed from, in exact arithmetic: a bias's gradient "
            f"before a BatchNorm); its own error {sci(local.rel_l2)} is within that")


def culprit_reason(local: LocalResult) -> str:
    """Why a call's own result is blamed, in the verdict's words (its row's reason when flagged inside tolerance)."""
    if local.recipe and not local.metrics.num_mismatch:
        return recipe_error(local.recipe, local.error, local.ratio, local.expected, local.format_cost)
    return own_error(local.tensor, local.rel_l2, local.ratio, local.expected, local.metrics.num_mismatch,
                      local.calibrated)


def calibration_reason(local: LocalResult) -> str:
    """Why a call's calibration is not trusted, with both figures (the `calibration` finding's reason)."""
    return (f"{_noise_claim(local.calibration, local.calibrated, local.expected)}; its own error rel_l2 "
            f"{sci(local.rel_l2)} is within {local.factor:g}x that, so the call is neither cleared nor blamed")


def _noise_claim(calibration: Any, calibrated: Any, expected: Any) -> str:
    """`its calibrated noise N is Rx what the precision can produce for it (B, on the trusted path): not used`."""
    ratio = (num(calibrated) or 0.0) / (num(expected) or math.inf)
    if str(calibration or "").startswith("device"):
        return (f"the device's own noise {sci(calibrated)} for it is {ratio:.0f}x the trusted CPU's "
                f"({sci(expected)}, the precision's modes as recorded): a finding about the device's kernels, not "
                f"used as noise")
    return (f"its calibrated noise {sci(calibrated)} is {ratio:.0f}x what its precision can produce for it "
            f"({sci(expected)}, measured on the trusted path): calibration not trusted, not used as noise")


def own_error(tensor: Any, rel_l2: Optional[float], ratio: Optional[float], expected: Optional[float],
               nan_mismatch: Optional[int], calibrated: Any = None) -> str:
    """Why a call's own result is blamed: its error against its expected noise, or NaN/Inf it made; and when its
    calibrated noise was not trusted (above the expected one, which is then the bound's), both figures."""
    if nan_mismatch:
        return (f"{nan_mismatch} NaN/Inf at other positions (or with another sign) than in the reference, "
                f"given the same inputs")
    tensor = str(tensor)
    if tensor == CLIP_ROW:  # judged on the target's own gradients (`record/local/clipping.py`)
        return (f"the coefficient the gradient clipping applied is rel {sci(rel_l2)} off min(1, max_norm / total "
                f"norm) of the float64 norm of the gradients backward left (max_norm: the reference's clipping's), "
                f"{num(ratio) or 0:.1f}x the rounding of those norms {sci(expected)}")
    own = f"its own code's (what it hands {tensor.partition(':')[0]})" if ":" in tensor else "its own code's"
    text = (f"{own} error rel_l2 {sci(rel_l2)}, on the reference's inputs, is "
            f"{num(ratio) or 0:.1f}x its expected noise {sci(expected)}")
    cal, exp = num(calibrated), num(expected)
    if cal is not None and exp is not None and cal > exp:
        text += (f" (what its precision can produce for it; its calibrated noise {sci(calibrated)} is not "
                 f"trusted, far above that)")
    return text


def nonfinite_differs(e: dict) -> bool:
    ref = (e.get("num_nan_ref"), e.get("num_inf_ref"))
    return ref != (e.get("num_nan_target"), e.get("num_inf_target"))


def _nan_inf(e: dict) -> str:
    return f"NaN {e['num_nan_ref']} vs {e['num_nan_target']}, Inf {e['num_inf_ref']} vs {e['num_inf_target']}"


def numbers(e: dict) -> str:
    """An entry's difference: NaN/Inf counts first when they differ, then the metrics of the finite elements."""
    if num(e.get("rel_l2")) is None:
        return f"{str(e.get('entry_status', '')).replace('_', ' ')} ({e.get('reason', '')})"
    if str(e.get("reason") or "").startswith(STATS_REASON):  # `--level stats`: no elementwise numbers exist
        return str(e["reason"])
    numbers = (f"max_abs {sci(e.get('max_abs'))} max_rel {sci(e.get('max_rel'))} rel_l2 {sci(e.get('rel_l2'))} "
               f"cosine {num(e.get('cosine')):.6f}")
    if num(e.get("frac_out")) is not None and num(e.get("atol")) is not None:
        numbers += (f", {num(e['frac_out']):.2%} of elements outside atol {num(e['atol']):.1e} "
                    f"rtol {num(e['rtol']):.1e}")
    if nonfinite_differs(e) and e.get("num_nan_ref") is not None:
        return f"{_nan_inf(e)} (reference vs target); finite elements: {numbers}"
    if num(e.get("need_atol")) is not None:
        numbers += f" (would pass with atol {num(e['need_atol']):.1e} or rtol {num(e['need_rtol']):.1e})"
    return numbers


def first_divergence_line(first: dict) -> str:
    """The first entry outside tolerance, labelled as such: with local data it is seldom the culprit."""
    size = f" (rel_l2 {sci(first.get('rel_l2'))})" if num(first.get("rel_l2")) is not None else ""
    if nonfinite_differs(first) and first.get("num_nan_ref") is not None:
        size = f" ({_nan_inf(first)})"
    drift = {"drift": ": accumulated drift, which the verdict does not rest on",
             "rounding": ": its own call's rounding (computed from values bitwise the reference's), within its "
                         "noise"}.get(str(first.get("entry_status")), "")
    if first.get("entry_status") == "rounding" and str(first.get("reason") or "").startswith(ROUNDING_VALUE):
        drift = ": rounding itself (its precision's own error for it is as large as the value), within its noise"
    return (f"first divergence: #{first.get('index')} {entry_name(first)}{size}, the first entry outside "
            f"tolerance{drift}")


def compiled_lines(c: Optional[dict]) -> list[str]:
    """Which side ran compiled blocks, what compiling cost, its graph breaks, and what the blocks hide."""
    if not c:
        return []
    lines = []
    for side in ("target", "reference"):
        info = c.get(side) or {}
        blocks = info.get("blocks") or {}
        if not blocks:
            continue
        each = "; ".join(f"{path or ROOT_MODULE} ({b.get('backend', '?')}, "
                         f"{_count(b.get('graphs'), 'graph') if b.get('graphs') else 'no new graph'})"
                         for path, b in list(blocks.items())[:6])
        more = f"; {len(blocks) - 6} more" if len(blocks) > 6 else ""
        breaks = info.get("graph_breaks") or []
        rerun = num(info.get("rerun_compile_seconds")) or 0.0  # what `record` printed is the sum of both
        reruns = f" (+{rerun:.1f} s for its reruns)" if rerun else ""
        lines.append(f"compiled: the {side} ran {_count(len(blocks), 'compiled block')}: {each}{more}; "
                     f"{_count(len(breaks), 'graph break')}, {num(info.get('compile_seconds')) or 0.0:.1f} s "
                     f"compiling{reruns}, not in its record time")
        for gb in breaks[:5]:
            block = "the iteration" if gb.get("block") is None else gb["block"] or ROOT_MODULE
            lines.append(f"compiled: graph break in {block} at {gb.get('where')}: {gb.get('reason')}")
        for path, b in list(blocks.items())[:6]:
            if b.get("eager"):
                lines.append(f"compiled: {path or ROOT_MODULE} in the {side}: {b['eager']}")
        lines += random_lines(info, side)
    for side, other in (("target", "reference"), ("reference", "target")):
        hidden = [h for h in c.get("hidden") or [] if h.get("side") == side]
        if not hidden:
            continue
        entries, calls = sum(int(h.get("entries") or 0) for h in hidden), sum(int(h.get("calls") or 0) for h in hidden)
        each = ", ".join(f"{h.get('block') or ROOT_MODULE} {h.get('entries')}" for h in hidden[:6])
        lines.append(f"compiled: {_count(entries, 'entry', 'entries')} of {_count(calls, 'call')} the {other} "
                     f"recorded inside the {side}'s compiled blocks ({each}) are not compared: of a compiled block "
                     f"only its inputs, outputs and their gradients, and its parameters' gradients and updates are "
                     f"observable, not the calls inside it")
    return lines


def _count(n, one: str, many: str = "") -> str:
    n = int(n or 0)
    return f"{n} {one if n == 1 else (many or one + 's')}"


def precision_lines(p: Optional[dict]) -> list[str]:
    """What each side ran in a reduced float32 precision (TF32 convolutions...), and how the noise accounts for it."""
    if not p:
        return []
    cal = p.get("calibrated") or {}
    lines = []
    for side in ("target", "reference"):
        ran = describe(p.get(side) or {})
        if not ran:
            continue
        emulated = reduced(cal.get(side) or {})
        calls = int(cal.get(f"{side}_calls") or 0)
        modes = "/".join(sorted({m.upper() for m in emulated.values()}))
        if emulated:
            how = f"the noise of {calls} calls calibrated with {modes} operands" if calls else \
                f"reproduced with {modes} operands, but no call needed calibration"
        elif side == "target":
            how = "calibrated on the device, which runs them so" if cal.get("where") == "device" else "not reproduced"
        elif reduced(p.get("reference")) == reduced(p.get("target")):
            how = "as the target: the target's noise stands for it"
        else:
            how = "finer than the target's precision: its noise is not measured"
        lines.append(f"precision: the {side} ran float32 {ran}: {how}")
    return lines


def untrusted_lines(untrusted: tuple[dict, ...]) -> list[str]:
    """Every call whose calibration was not trusted, with both figures (the first few; all in the JSON report)."""
    if not untrusted:
        return []
    shown = "; ".join(f"{entry_name(u)}: {_noise_claim(u.get('calibration'), u.get('calibrated'), u.get('expected'))}"
                      f" ({'flagged' if u.get('flagged') else 'within that'} with its own error "
                      f"{sci(u.get('rel_l2'))})" for u in untrusted[:3])
    more = f"; {len(untrusted) - 3} more in the JSON report" if len(untrusted) > 3 else ""
    return [f"calibration not trusted ({len(untrusted)} tensors): {shown}{more}"]


def _pct(value: float) -> str:
    return "n/a" if num(value) is None or math.isnan(value) else f"{100 * value:.0f} %"


def first_fix(impact: Optional[Impact]) -> list[str]:
    """The line naming the fix that matters most (`record --impact`): the first of the ranking, what it closes; none
    where a rounding moves the gaps as far as a fix (`Impact.evidence`: `ranking_lines` says so)."""
    if impact is None or impact.note or not impact.fixes or not impact.fixes[0].measured or not impact.evidence:
        return []
    fix, n = impact.fixes[0], len(impact.fixes)
    of = f", the most of the {n} flagged calls fixed one at a time" if n > 1 else ""
    close = [f for f in impact.fixes[1:] if f.measured and _apart(fix, f, impact) <= impact.sensitivity]
    if close:  # within what one rounding moves: their order is not told apart
        of += f" ({', '.join(f.name for f in close)} within one rounding's reach of it: not told apart)"
    if impact.step is not None:  # over several steps: the loss gap of the last step, each call fixed at every step
        return [f"fix first: {fix.name} ({fix.phase} {fix.tensor}), fixed at every step: it closes "
                f"{_pct(fix.share)} of the loss gap at step {impact.step}{of}"]
    if impact.by_loss:
        return [f"fix first: {fix.name} ({fix.phase} {fix.tensor}): fixing it closes {_pct(fix.share)} of the loss "
                f"gap (gradients {_pct(fix.grad_share)}, updated weights {_pct(fix.weight_share)}){of}"]
    return [f"fix first: {fix.name} ({fix.phase} {fix.tensor}): the loss is the reference's bit for bit; fixing it "
            f"closes {_pct(fix.grad_share)} of the gradients' gap (updated weights {_pct(fix.weight_share)}){of}"]


def impact_lines(impact: Optional[Impact]) -> list[str]:
    """Every sentence about the ranking (`record --impact`): the fix that matters most first (a multi-step
    comparison's verdict states them too: `judge/stepwise/step_verdict.py`)."""
    return [*first_fix(impact), *ranking_lines(impact)]


def _apart(a, b, impact: Impact) -> float:
    key = "share" if impact.by_loss else "grad_share"
    return abs(getattr(a, key) - getattr(b, key))


def ranking_lines(impact: Optional[Impact]) -> list[str]:
    """How far a rounding moves the gaps, what every fix together leaves (the precision's part), whether the fixes
    interact, what was not fixed."""
    if impact is None or (not impact.fixes and not impact.note):
        return []  # not asked for, or nothing flagged: no ranking
    if impact.note:
        return [f"impact: {impact.note}"]
    what = "loss gap" if impact.by_loss else "gradients' gap"
    what += f" at step {impact.step}" if impact.step is not None else ""
    lines = []
    if not impact.evidence:
        return [f"impact: no ranking: one rounding of the weights moves the {what} by {_pct(impact.sensitivity)}, "
                f"as far as a fix does: this iteration is too sensitive to tell the {len(impact.fixes)} fixes apart "
                f"(the table's shares are no evidence)"]
    if impact.sensitivity > SENSITIVITY_SAID:
        lines.append(f"impact: one rounding of the weights moves the {what} by {_pct(impact.sensitivity)}: shares "
                     f"closer than that are not told apart")
    measured = [f for f in impact.fixes if f.measured]
    if measured and not math.isnan(impact.leaves):
        every = f"with all {len(impact.fixes)} fixed" if len(impact.fixes) > 1 else "with it fixed"
        if len(measured) == len(impact.fixes):
            lines.append(f"impact: {every}, the precision alone leaves {_pct(impact.leaves)} of the {what}")
        else:
            lines.append(f"impact: {every} ({len(impact.fixes) - len(measured)} could not be: below), "
                         f"{_pct(impact.leaves)} of the {what} is left")
    if impact.interacts:
        lines.append(f"impact: the shares of the {len(measured)} fixes add up to {_pct(impact.total)}, all of them "
                     f"together close {_pct(1 - impact.leaves)}: the fixes interact (each share is measured with "
                     f"the other calls as they are)")
    if impact.top is not None and impact.num_flagged > len(impact.fixes):
        lines.append(f"impact: the {len(impact.fixes)} largest own errors of {impact.num_flagged} flagged calls "
                     f"were fixed (--impact-top {impact.top})")
    missed = [f for f in impact.fixes if not f.measured]
    if missed:
        lines.append("impact: " + "; ".join(f"{f.name} {f.note or 'not measured'}" for f in missed))
    return lines
