"""The zoo sweep: model code nobody on this project wrote, each model recorded, replayed clean and with faults.

    python bench/zoo.py                                   # every model of tests/model_files/zoo_models.py (hours)
    nice python bench/zoo.py --only llama,nn_mha_self     # a few models
    python bench/zoo.py --family encoder --cases clean,bf16
    python bench/zoo.py --report --table docs/zoo.md      # the table and totals of what is cached, nothing run

Per model (`tests/model_files/zoo_models.py`: Hugging Face architectures from tiny random configs, stock `torch.nn`
families, torchtitan's Llama where it imports): a float32 reference (1 thread, batch 2), then replays of it
that must be a MATCH (`clean`: the same settings; `threads`: 2 threads; `bf16`: bf16 autocast), and replays with
a fault that must be *named*, module and phase: 1e-3 in float32 (`fwd`, `bwd`), 5e-2 under bf16 autocast
(`bf16_fwd`, `bf16_bwd`), once in a module (`module_*`) and once in a `torch.nn.functional` function
(`function_*`). The faults are the model file's own (`faultkit`, env ONEITER_TEST_FAULT): oneiter is never told.

Where a fault goes is a rule (`fault_sites`), run on the model before anything is recorded, never a choice by hand:
- **module**: the leaf modules owning parameters that ran in a forward with a floating input that requires a
  gradient, in the order of their first call; the one two thirds down that list (index `2n // 3`). Its
  instance's forward is wrapped (its outputs, or only their gradients, scaled);
- **function**: the `torch.nn.functional` functions called in that forward with a floating result that requires
  a gradient (dropouts and in-place variants aside); the one called most often from the model's own code (a module
  class outside `torch.nn`), else from a container's code, else at all; ties go to the one called first. It is
  replaced everywhere. Every module whose own code calls it is faulty; a forward fault is expected at the first
  call's module, a backward fault at the last call's (backward runs last-called first); naming any module that
  calls it, in the right phase, counts as named.

A case's outcome: `ok` (a clean replay MATCH; a fault named), `FALSE ALARM` (a clean replay not a MATCH),
`misnamed` (DIVERGED, but another module or phase), `missed` (MATCH on a fault), `error` (oneiter raised), `n/a`
(the model cannot run in the case's settings even without oneiter: torch's CPU LSTM has no bf16 kernel here).
Results are cached per model and case in `--cache` (JSON, one file per model): a second run only runs what is
missing (`--rerun` forgets the selected cases). Each model runs in its own process (`--timeout` seconds at most),
its reference in another one, with another Python hash seed (`REFERENCE_HASH_SEED`), as a user's two runs are.
`--json` writes the summary, `--table` the Markdown table (model x case -> verdict, culprit, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
MODEL_FILES = ROOT / "tests" / "model_files"
SPEC = f"{MODEL_FILES / 'zoo_models.py'}:build"
FAULT_ENV = "ONEITER_TEST_FAULT"
# one intra-op thread: on cores other processes share, two OpenMP threads spin-wait for each other (the tiny Llama's
# three cases took 103 s wall, 15 s CPU with two, 47 s and 6 s with one, at load 16); the `threads` case runs two
BATCH, SEED, THREADS, OTHER_THREADS = 2, 0, 1, 2

# case -> (replay options, fault family or None, REL)
CASES: dict[str, tuple[dict, str | None, float]] = {
    "clean": ({}, None, 0.0),
    "threads": ({"threads": OTHER_THREADS}, None, 0.0),
    "bf16": ({"amp": "bf16"}, None, 0.0),
    "module_fwd": ({}, "instance", 1e-3),
    "module_bwd": ({}, "instance_bwd", 1e-3),
    "function_fwd": ({}, "function", 1e-3),
    "function_bwd": ({}, "function_bwd", 1e-3),
    "module_bf16_fwd": ({"amp": "bf16"}, "instance", 5e-2),
    "module_bf16_bwd": ({"amp": "bf16"}, "instance_bwd", 5e-2),
    "function_bf16_fwd": ({"amp": "bf16"}, "function", 5e-2),
    "function_bf16_bwd": ({"amp": "bf16"}, "function_bwd", 5e-2),
}
CLEAN = ("clean", "threads", "bf16")


def zoo_module():
    """tests/model_files/zoo_models.py as a module (its folder on sys.path, as oneiter puts a model file's)."""
    if str(MODEL_FILES) not in sys.path:
        sys.path.insert(0, str(MODEL_FILES))
    import zoo_models

    return zoo_models


# -- the fault-site rule ------------------------------------------------------------------------------------------

def _functional_names() -> list[str]:
    """The public functions of torch.nn.functional a fault can replace (no dropout, no in-place variant)."""
    import torch.nn.functional as F

    names = []
    for name, obj in vars(F).items():
        if name.startswith("_") or name.endswith("_") or "dropout" in name or "torch_function" in name:
            continue
        if (inspect.isfunction(obj) or inspect.isbuiltin(obj)) and name not in ("boolean_dispatch",
                                                                                   "assert_int_or_pair"):
            names.append(name)
    return names


def _grad_floats(value) -> bool:
    """Whether `value` (a tensor or a tuple/list of them) holds a floating tensor that requires a gradient."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_grad_floats(v) for v in value)
    if isinstance(value, dict):
        return any(_grad_floats(v) for v in value.values())
    return False


def fault_sites(name: str) -> dict:
    """The rule (module docstring): where the module fault and the function fault go in zoo model `name`.

    Builds the model as a recording does (seed `SEED`, batch `BATCH`, train mode), runs one forward with every
    torch.nn.functional function counted (installed before the model is built, as faultkit patches them) and a
    stack of the module calls running; nothing of oneiter is involved."""
    import torch
    import torch.nn.functional as F

    zoo = zoo_module()
    originals = {n: getattr(F, n) for n in _functional_names()}
    stack: list[str] = []
    calls: list[tuple[str, str]] = []  # (function, innermost module path), in call order

    def counting(fname, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            if _grad_floats(out):
                calls.append((fname, stack[-1] if stack else ""))
            return out

        return wrapper

    for fname, fn in originals.items():
        setattr(F, fname, counting(fname, fn))
    try:
        torch.manual_seed(SEED)
        model, inputs, _ = zoo.build(BATCH, name)
        leaves = _trace(model, inputs, stack)
    finally:
        for fname, fn in originals.items():
            setattr(F, fname, fn)
        zoo.undo_faults()
    kinds = {p: type(m) for p, m in model.named_modules()}
    return {"module": leaves[(2 * len(leaves)) // 3] if leaves else None, "num_leaves": len(leaves),
            **_function_site(calls, kinds)}


def _trace(model, inputs, stack: list[str]) -> list[str]:
    """One forward in train mode, seeded as a recording seeds its iteration (the same layers drop out: layerdrop),
    with `stack` holding the path of every module call running; returns the leaf modules owning parameters that
    were fed a floating tensor requiring a gradient, in the order of their first call."""
    import torch

    model.train()
    paths = {id(m): p for p, m in model.named_modules()}
    leaves: list[str] = []

    def pre(module, args, kwargs):
        path = paths.get(id(module), "?")
        stack.append(path)
        own = any(True for _ in module.parameters(recurse=False))
        feeds = _grad_floats(args) or _grad_floats(kwargs)
        if own and not any(True for _ in module.children()) and feeds and path not in leaves:
            leaves.append(path)

    def post(module, args, output):
        stack.pop()

    handles = []
    try:
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post))
        torch.manual_seed(SEED)
        model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return leaves


def _function_site(calls: list[tuple[str, str]], kinds: dict[str, type]) -> dict:
    """The function of the rule, the modules whose own code calls it, and where each fault is expected."""
    import torch.nn as nn

    def stock(path: str) -> bool:
        return kinds.get(path, nn.Module).__module__.startswith("torch.nn")

    def leaf_stock(path: str) -> bool:
        return stock(path) and not any(p.startswith(path + ".") for p in kinds if path)

    tiers = (
        [c for c in calls if not stock(c[1])],  # the model's own code
        [c for c in calls if not leaf_stock(c[1])],  # a container's code (stock ones too: nn.TransformerEncoderLayer)
        calls,
    )
    chosen = next((tier for tier in tiers if tier), [])
    if not chosen:
        return {"function": None}
    counts = Counter(f for f, _ in chosen)
    first = {f: i for i, (f, _) in reversed(list(enumerate(chosen)))}
    fname = max(counts, key=lambda f: (counts[f], -first[f]))
    where = [m for f, m in calls if f == fname]
    return {"function": fname, "function_calls": len(where), "function_first": where[0],
            "function_last": where[-1], "function_modules": sorted(set(where))}


# -- one case -----------------------------------------------------------------------------------------------------

def _record(out: Path, name: str, fault: str | None = None, **options):
    """A reference (no `replay` in options) or a replay of one, with the model file's own fault `fault`."""
    from oneiter.record.run import SpecOptions, record

    zoo = zoo_module()
    if fault:
        os.environ[FAULT_ENV] = fault
    try:
        if "replay" not in options:
            options = {"batch_size": BATCH, "seed": SEED, "model_args": {"name": name}, **options}
        return record(SpecOptions(out=out, model=SPEC, **{"threads": THREADS, **options}))
    finally:
        os.environ.pop(FAULT_ENV, None)
        zoo.undo_faults()


# A reference and its replays run in separate processes, as a user runs them: Python's string hashing, and with it
# the order of a set of strings, is per process (ModernBERT computes its rotary embeddings in the order of
# `set(config.layer_types)`). The reference's process and the workers' get two seeds that order them differently.
REFERENCE_HASH_SEED, WORKER_HASH_SEED = "0", "1"


def reference(work: Path, name: str) -> Path:
    """The float32 reference of zoo model `name` in `work` (recorded once, in a process of its own)."""
    ref = work / f"{name}.ref.h5"
    if not ref.exists():
        env = {**os.environ, "PYTHONHASHSEED": REFERENCE_HASH_SEED}
        cmd = [sys.executable, str(HERE), "--reference", name, "--work", str(work)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not ref.exists():
            tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-1:])
            raise RuntimeError(f"the reference of {name} failed (exit {done.returncode}): {tail}")
    return ref


def expected(case: str, sites: dict) -> dict | None:
    """What a fault case must name: {fault, modules, phase, at} (None for a clean case); `fault` is None when the
    rule found no site."""
    options, family, rel = CASES[case]
    if family is None:
        return None
    phase = "backward" if family.endswith("_bwd") else "forward"
    if family.startswith("instance"):
        site = sites.get("module")
        return {"fault": site and f"{family}:{site}:{rel:g}", "modules": [site], "phase": phase, "at": site}
    fname = sites.get("function")
    at = sites.get("function_first" if phase == "forward" else "function_last")
    return {"fault": fname and f"{family}:{fname}:{rel:g}", "modules": sites.get("function_modules", []),
            "phase": phase, "at": at}


def run_case(work: Path, name: str, case: str, sites: dict) -> dict:
    """Replay zoo model `name`'s reference as `case` says, compare, and judge the outcome (module docstring)."""
    import oneiter
    from oneiter.errors import OneIterError

    options, _, _ = CASES[case]
    want = expected(case, sites)
    result = {"model": name, "case": case, "expected": want}
    if want is not None and want["fault"] is None:
        return {**result, "outcome": "no site", "verdict": None, "seconds": 0.0}
    started = time.perf_counter()
    target = work / f"{name}.{case}.h5"
    try:
        ref = reference(work, name)
        started = time.perf_counter()
        _record(target, name, want and want["fault"], replay=ref, **options)
        verdict = oneiter.compare(ref, target).verdict_obj
    except (OneIterError, Exception) as exc:  # noqa: BLE001 - every failure is a row of the table
        kind = "user error" if isinstance(exc, OneIterError) else "internal error"
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
        plain = plain_failure(name, options)  # does the model run in these settings at all, without oneiter?
        return {**result, "outcome": "n/a" if plain else "error", "verdict": None,
                "error": f"without oneiter too: {plain}" if plain else f"{kind}: {text}",
                "seconds": round(time.perf_counter() - started, 2)}
    finally:
        target.unlink(missing_ok=True)
    seconds = round(time.perf_counter() - started, 2)
    culprit = verdict.culprit
    found = {"status": verdict.status, "basis": verdict.basis, "focus": verdict.focus,
             "module": culprit.module if culprit else verdict.where.get("module"),
             "call": culprit.call if culprit else verdict.where.get("call"),
             "phase": culprit.phase if culprit else verdict.where.get("phase"),
             "tensor": culprit.tensor if culprit else verdict.where.get("tensor"),
             "ratio": culprit.ratio if culprit else None, "rel_l2": culprit.local_rel_l2 if culprit else None,
             "headline": verdict.headline[:400],
             "worst_local": verdict.worst_local}  # on a miss: the call nearest to being flagged
    return {**result, "outcome": judge_outcome(found, want), "verdict": found, "seconds": seconds}


def plain_failure(name: str, options: dict) -> str | None:
    """The exception one plain training iteration of zoo model `name` raises in a case's settings (bf16 autocast),
    with no oneiter anywhere; None when it runs. torch's CPU LSTM has no bf16 kernel here (oneDNN: "could not create a
    primitive descriptor"): such a case is not applicable, neither a false alarm nor a miss."""
    import torch

    zoo = zoo_module()
    torch.manual_seed(SEED)
    model, inputs, loss_fn = zoo.build(BATCH, name)
    model.train()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if options.get("amp") == "bf16" else None
    try:
        with amp if amp is not None else contextlib.nullcontext():
            loss = loss_fn(model(*inputs))
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is torch's or the model's, not oneiter's
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    finally:
        zoo.undo_faults()
    return None


def judge_outcome(found: dict, want: dict | None) -> str:
    """ok / FALSE ALARM (clean) or ok / misnamed / missed (fault)."""
    if want is None:
        return "ok" if found["status"] == "match" else "FALSE ALARM"
    if found["status"] == "match":
        return "missed"
    named = (found["basis"] == "local_error" and found["module"] in want["modules"]
             and found["phase"] == want["phase"])
    return "ok" if named else "misnamed"


# -- the worker: one model, its missing cases ---------------------------------------------------------------------

def cache_file(cache: Path, name: str) -> Path:
    return cache / f"{name}.json"


def load_cached(cache: Path, name: str) -> dict:
    path = cache_file(cache, name)
    return json.loads(path.read_text()) if path.exists() else {"model": name, "cases": {}}


def _save(cache: Path, name: str, data: dict) -> None:
    path = cache_file(cache, name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def worker(name: str, cases: list[str], cache: Path, work: Path) -> None:
    """Run `cases` of model `name` that the cache lacks; save each result as it comes, print one line per case."""
    zoo = zoo_module()
    data = load_cached(cache, name)
    entry = zoo.MODELS[name]
    data.update({"family": entry.family, "source": entry.source})
    if "sites" not in data:
        try:
            data["sites"] = fault_sites(name)
        except Exception as exc:  # noqa: BLE001 - the model does not build or run here (a missing package)
            data["unavailable"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            _save(cache, name, data)
            print(f"{name}: unavailable: {data['unavailable']}", flush=True)
            return
        _save(cache, name, data)
    work.mkdir(parents=True, exist_ok=True)
    try:
        for case in cases:
            if case in data["cases"]:
                continue
            res = run_case(work, name, case, data["sites"])
            data["cases"][case] = res
            _save(cache, name, data)
            print(progress_line(res), flush=True)
    finally:
        (work / f"{name}.ref.h5").unlink(missing_ok=True)


def progress_line(res: dict) -> str:
    v = res.get("verdict") or {}
    what = res.get("error") or (f"{v.get('status', '').upper()} {_culprit_text(v)}" if v else res["outcome"])
    return f"  {res['model']:20s} {res['case']:18s} {res['outcome']:12s} {what[:140]} ({res['seconds']:.1f} s)"


def _culprit_text(v: dict) -> str:
    if not v or v.get("status") == "match":
        return ""
    return f"{v.get('module')}@{v.get('call')} {v.get('phase')} {v.get('tensor')} [{v.get('basis')}]"


# -- the driver ---------------------------------------------------------------------------------------------------

def select(only: str | None, family: str | None) -> list[str]:
    zoo = zoo_module()
    names = list(zoo.MODELS)
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in zoo.MODELS]
        if unknown:
            raise SystemExit(f"unknown zoo models: {', '.join(unknown)} (known: {', '.join(names)})")
        names = wanted
    if family:
        names = [n for n in names if family.lower() in zoo.MODELS[n].family.lower()
                 or family.lower() == zoo.MODELS[n].source.lower()]
    return names


def run_all(names: list[str], cases: list[str], cache: Path, work: Path, timeout: float, rerun: bool) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names, 1):
        data = load_cached(cache, name)
        if rerun:
            for case in cases:
                data["cases"].pop(case, None)
            data.pop("sites", None)
            data.pop("unavailable", None)
            _save(cache, name, data)
        missing = [c for c in cases if c not in data["cases"]]
        if not missing or data.get("unavailable"):
            continue
        print(f"[{i}/{len(names)}] {name}: {len(missing)} case(s)", flush=True)
        cmd = [sys.executable, str(HERE), "--worker", name, "--cases", ",".join(missing), "--cache", str(cache),
               "--work", str(work)]
        try:
            subprocess.run(cmd, timeout=timeout, check=False, env={**os.environ, "PYTHONHASHSEED": WORKER_HASH_SEED})
        except subprocess.TimeoutExpired:
            data = load_cached(cache, name)
            for case in missing:
                data["cases"].setdefault(case, {"model": name, "case": case, "outcome": "error", "verdict": None,
                                                "error": f"timeout: the model's cases ran past {timeout:.0f} s",
                                                "seconds": timeout})
            _save(cache, name, data)
            print(f"  {name}: timed out after {timeout:.0f} s", flush=True)


def summary(names: list[str], cases: list[str], cache: Path) -> dict:
    """Every cached result of the selection, and the totals: clean replays, faults named, by outcome."""
    models, totals, seconds = {}, {"clean": Counter(), "fault": Counter()}, 0.0
    # n/a: the model does not run in the case's settings even without oneiter (plain_failure); no site: the rule
    # found none; neither is judged
    for name in names:
        data = load_cached(cache, name)
        models[name] = data
        for case in cases:
            res = data["cases"].get(case)
            if res is not None:
                totals["clean" if case in CLEAN else "fault"][res["outcome"]] += 1
                seconds += res.get("seconds") or 0.0
    clean, fault = totals["clean"], totals["fault"]
    judged_faults = sum(v for k, v in fault.items() if k not in ("no site", "n/a"))
    return {
        "models": models, "cases": cases,
        "totals": {
            "models": sum(1 for d in models.values() if d.get("cases")),
            "clean_runs": sum(v for k, v in clean.items() if k != "n/a"),
            "false_alarms": sum(v for k, v in clean.items() if k not in ("ok", "n/a")),  # errors too: not a MATCH
            "clean_errors": clean.get("error", 0),
            "not_applicable": clean.get("n/a", 0) + fault.get("n/a", 0),
            "faults": judged_faults, "faults_named": fault.get("ok", 0),
            "named_share": round(fault.get("ok", 0) / judged_faults, 4) if judged_faults else None,
            "clean_outcomes": dict(clean), "fault_outcomes": dict(fault), "seconds": round(seconds, 1),
        },
    }


SHORT = {"ok": "ok", "FALSE ALARM": "**FALSE ALARM**", "missed": "**missed**", "misnamed": "**misnamed**",
         "error": "**error**", "no site": "no site", "n/a": "n/a"}


def _cell(res: dict | None) -> str:
    """A matrix cell: MATCH / named (ok) or the outcome, and seconds."""
    if res is None:
        return ""
    v = res.get("verdict") or {}
    if res["outcome"] == "ok":
        what = "MATCH" if v.get("status") == "match" else "named"
    else:
        what = SHORT.get(res["outcome"], res["outcome"])
    return f"{what} {res['seconds']:.0f}s"


def _detail(name: str, case: str, res: dict) -> str:
    """One row of the full table: model, case, verdict, culprit (or the entry named), ratio, seconds, outcome."""
    v = res.get("verdict") or {}
    where = res.get("error") or (_culprit_text(v) if v.get("status") != "match" else "")
    ratio = v.get("ratio")
    ratio_text = f"{ratio:.3g}" if isinstance(ratio, (int, float)) and ratio == ratio else ""
    verdict = (v.get("status") or "").upper() or "-"
    return f"| {name} | {case} | {verdict} | {where} | {ratio_text} | {res['seconds']:.1f} | {res['outcome']} |"


def _note(name: str, case: str, got: dict) -> str:
    """What case `case` of the model's cases `got` found where it is not ok, what it had to find, and (a miss) the
    call nearest to being flagged and, where measured, why it was not (`_below_noise`)."""
    res = got[case]
    v = res.get("verdict") or {}
    what = res.get("error") or f"{(v.get('status') or '').upper()} {_culprit_text(v)}".strip()
    want = res.get("expected") or {}
    aim = f"; the fault: `{want.get('fault')}`, expected at {want.get('at')} ({want.get('phase')})" if want else ""
    worst = v.get("worst_local") or {}
    near = (f"; nearest to being flagged: {worst.get('module')}@{worst.get('call')} {worst.get('phase')} "
            f"{worst.get('tensor')} at {worst.get('ratio', 0):.2g}x (flagged above {worst.get('factor', 4):g}x)"
            if res["outcome"] == "missed" and worst else "")
    why = NOTES.get((name, case), "") or (_below_noise(case, got) if res["outcome"] == "missed" else "")
    return f"- **{name} {case}** ({res['outcome']}): {what}{aim}{near}" + (f". {why}" if why else "")


def _below_noise(case: str, got: dict) -> str:
    """Why a bf16 fault was missed, measured: its float32 twin (the same fault at 1e-3) was named at some entry, by
    an error that is a share of the fault; that share of this case's fault, against this case's own noise at the
    same entry (its call nearest to being flagged). Empty where the figures are not at hand."""
    twin = case.replace("_bf16", "")
    mine, theirs = got.get(case) or {}, got.get(twin) or {}
    if twin == case or theirs.get("outcome") != "ok" or not (theirs.get("verdict") or {}).get("rel_l2"):
        return ""
    named, worst = theirs["verdict"], (mine.get("verdict") or {}).get("worst_local") or {}
    size, twin_size = CASES[case][2], CASES[twin][2]
    moved = named["rel_l2"] / twin_size * size
    text = (f"below bf16's noise where it lands: the same fault at {twin_size:g} in float32 ({twin}, named) moved "
            f"{named['module']}@{named['call']} {named['phase']} {named['tensor']} by {named['rel_l2']:.3g}, "
            f"{100 * named['rel_l2'] / twin_size:.2g} % of the fault, so {size:g} moves it by about {moved:.2g}")
    same = all(worst.get(k) == named.get(k) for k in ("module", "call", "phase", "tensor"))
    if same and worst.get("expected"):
        text += (f", {moved / worst['expected']:.2g} times bf16's own noise there ({worst['expected']:.3g}; "
                 f"flagged above {worst.get('factor', 4):g} times)")
    elif worst.get("ratio") is not None:
        text += (f", and no entry of this replay, that one included, is above {worst['ratio']:.2g} times its bf16 "
                 f"noise (flagged above {worst.get('factor', 4):g} times)")
    return text


# Misses explained after looking at them (the measurement behind each is in docs/zoo.md)
_ZERO_TABLE = ("the right module, in the phase its fault shows in: BEiT's relative position bias table starts at zeros "
               "(its init; state_before's maximum |value| is 0 in the zoo's reference), so both calls' forward "
               "outputs are all 0 and a fault scaling interpolate's result leaves them 0; the call takes no tensor "
               "input, so the fault's only effect in this iteration is the table's gradient: param_grad, named at "
               "the first call whose code calls it")
_FIRST_LAYER = ("the right module, in the phase its fault shows in: conv2d runs once, in down.0, the first layer, "
                "whose input is the batch (no gradient), so the only gradient the faulted backward gives is its "
                "weight's: param_grad, not backward")
_BATCH_PAD = ("the fault's first site, named: MobileNetV2 pads the batch itself (first_conv's TF padding, before its "
              "convolution); the site rule counts only calls whose output needs a gradient, so it expects the first "
              "pad in conv_3x3, while the fault changes this one too, and the verdict names it: first_conv's forward, "
              "the padded input it hands its convolution")
NOTES: dict[tuple[str, str], str] = {
    ("mobilenet_v2", "function_fwd"): _BATCH_PAD, ("mobilenet_v2", "function_bf16_fwd"): _BATCH_PAD,
    ("nn_conv_transpose", "function_bwd"): _FIRST_LAYER, ("nn_conv_transpose", "function_bf16_bwd"): _FIRST_LAYER,
    **{("beit", case): _ZERO_TABLE for case in ("function_fwd", "function_bwd", "function_bf16_fwd",
                                                 "function_bf16_bwd")},
}


def markdown(summ: dict) -> str:
    """The tables: totals; a matrix of model x case (MATCH, named, or the outcome, and seconds); every case with its
    verdict, culprit, ratio and seconds; every case that is not ok, explained; the fault sites."""
    cases = summ["cases"]
    t = summ["totals"]
    lines = [f"Models: {t['models']}. Clean replays: {t['clean_runs']}, not a MATCH: {t['false_alarms']} "
             f"({t['clean_errors']} of them errors). "
             f"Faults: {t['faults']}, named (module and phase): {t['faults_named']}"
             + (f" ({100 * t['named_share']:.1f} %)" if t["named_share"] is not None else "")
             + f". Not applicable (the model cannot run so, without oneiter too): {t.get('not_applicable', 0)}. "
             f"Seconds, summed over the cases (each replay and its compare; references aside): {t['seconds']:.0f}.",
             ""]
    lines += ["| model | family | " + " | ".join(cases) + " |", "|---|---|" + "---|" * len(cases)]
    details = ["| model | case | verdict | culprit (or the entry named) | ratio | s | outcome |",
               "|---|---|---|---|---|---|---|"]
    notes = []
    for name, data in summ["models"].items():
        if data.get("unavailable"):
            lines.append(f"| {name} | {data.get('family', '')} | " + " | ".join("n/a" for _ in cases) + " |")
            notes.append(f"- **{name}**: not run: {data['unavailable']}")
            continue
        got = data.get("cases", {})
        if not got:
            continue  # not run (yet): a sweep cut short
        lines.append(f"| {name} | {data.get('family', '')} | " + " | ".join(_cell(got.get(c)) for c in cases) + " |")
        for case in cases:
            if case in got:
                details.append(_detail(name, case, got[case]))
                if got[case]["outcome"] != "ok":
                    notes.append(_note(name, case, got))
    sites = [f"- {name}: module `{d['sites'].get('module')}`, function `{d['sites'].get('function')}`"
             for name, d in summ["models"].items() if d.get("sites")]
    return "\n".join([*lines, "", "Every case that is not ok:", "", *(notes or ["- none"]), "", "Every case:", "",
                      *details, "", "Fault sites (the rule of `bench/zoo.py`):", "", *sites, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated zoo model names")
    parser.add_argument("--family", help="models whose family contains this (or whose source is it: hf, torch.nn)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all)")
    parser.add_argument("--cache", type=Path, default=ROOT / "zoo-results" / "cases")
    parser.add_argument("--work", type=Path, default=None, help="where recordings go (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per model at most")
    parser.add_argument("--rerun", action="store_true", help="forget the cached results of the selected cases")
    parser.add_argument("--report", action="store_true", help="run nothing: totals and table of the cache")
    parser.add_argument("--json", type=Path, help="write the summary JSON here")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases: {', '.join(unknown)} (known: {', '.join(CASES)})")
    if args.worker:
        worker(args.worker, cases, args.cache, args.work)
        return 0
    if args.reference:
        _record(args.work / f"{args.reference}.ref.h5", args.reference)
        return 0
    import tempfile

    names = select(args.only, args.family)
    started = time.perf_counter()
    if not args.report:
        with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
            run_all(names, cases, args.cache, args.work or Path(tmp), args.timeout, args.rerun)
    summ = summary(names, cases, args.cache)
    summ["wall_seconds"] = round(time.perf_counter() - started, 1)
    t = summ["totals"]
    print(f"{t['models']} models; clean replays {t['clean_runs']}, false alarms {t['false_alarms']}; faults "
          f"{t['faults']}, named {t['faults_named']} ({t['named_share']}); {summ['wall_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(summ, indent=1, sort_keys=True))
    if args.table:
        write_table(args.table, markdown(summ))
    return 0


BEGIN, END = "<!-- zoo table: begin -->", "<!-- zoo table: end -->"


def write_table(path: Path, table: str) -> None:
    """The table into `path`: between its BEGIN and END markers where it has them (docs/zoo.md: the prose around
    the table stays), else the whole file."""
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        table = f"{head}{BEGIN}\n\n{table}\n{END}{rest.split(END, 1)[1]}"
    path.write_text(table)


if __name__ == "__main__":
    sys.exit(main())
