"""Which entries of two recordings pair up, in which order, and whether two recordings may be compared at all.

The first steps of every comparison (`engine.py` for one iteration, `judge/stepwise/` for each step of two multi-step
recordings): entries are paired by (module path, call index, phase, tensor name), never by position, so one extra
call on one side shows up as a missing entry instead of shifting every later pair; the pairs are put in causal
order (forward in capture order, backward in the order gradients were computed, then parameter gradients, then
updated parameters); an entry one side holds of a call inside a block the other side ran compiled is left out
(`hidden`); two recordings of different models, or a "replay" that did not start where its reference
did, are refused before anything is measured.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np

from oneiter.errors import FormatError
from oneiter.format.layout import Entry, IterationFile
from oneiter.format.optimizer_state import LOADED, OPTIMIZER_STATE
from oneiter.format.schema import (
    OPTIMIZER,
    ROOT_MODULE,
    STATE_AFTER,
    STATE_BEFORE,
    STATE_NAMES,
    natural_key,
    optimizer_entry,
    seq_kind,
    split_optimizer_entry,
)
from oneiter.judge.iteration.entries import PHASES
from oneiter.runtime.training import OPTIMIZERS

__all__ = ["positions", "causal_pairs", "hidden", "check_compatible", "check_replay", "same_start"]

_KIND_RANK = {"input": 0, "output": 1, "grad_output": 0, "grad_input": 1}
_NO_ANCHOR = (-1, 0, 0, ())


def positions(f: IterationFile) -> dict[tuple[Optional[str], int], int]:
    """(module, call) -> execution position (module None: a call recorded without its module's name)."""
    return {(attrs.get("module"), int(attrs.get("call", 0))): i for i, (_, attrs) in enumerate(f.calls())}


def _sort_key(entry: Entry, positions: dict) -> tuple:
    """Causal position of an entry inside its file; ties (tensors captured at one moment) broken by call order."""
    rank = PHASES.index(entry.phase)
    if entry.phase in ("forward", "backward"):
        pos = positions.get((entry.module, entry.call), 0)
        tie = pos if entry.phase == "forward" else -pos  # without seq attrs: backward runs calls in reverse
        kind = _KIND_RANK.get(seq_kind(entry.tensor), 2)
        return (rank, entry.seq, tie, kind, natural_key(entry.tensor))
    return (rank, entry.seq, 0, 0, natural_key(entry.tensor))


def causal_pairs(
    ref_entries: list[Entry], tgt_entries: list[Entry], ref_positions: dict, tgt_positions: dict
) -> list[tuple[Optional[Entry], Optional[Entry]]]:
    """(reference, target) pairs by key, in the reference's causal order.

    An entry only the target has goes right after the target entry that precedes it and the reference also has,
    so it lands where it happened instead of at the end.
    """
    tgt_by_key = {e.key: e for e in tgt_entries}
    ref_keys = {e.key: _sort_key(e, ref_positions) for e in ref_entries}
    ordered: list[tuple[tuple, Optional[Entry], Optional[Entry]]] = [
        (ref_keys[e.key] + (0, 0), e, tgt_by_key.get(e.key)) for e in ref_entries]
    anchor: tuple = ()  # set by the first target entry (its phase differs from None)
    phase: Optional[str] = None
    for j, entry in enumerate(sorted(tgt_entries, key=lambda e: _sort_key(e, tgt_positions))):
        if entry.phase != phase:
            anchor, phase = (PHASES.index(entry.phase),) + _NO_ANCHOR, entry.phase
        if entry.key in ref_keys:
            anchor = ref_keys[entry.key]
        else:
            ordered.append((anchor + (1, j), None, entry))
    ordered.sort(key=lambda item: item[0])
    return [(r, t) for _, r, t in ordered]


# -- compatibility --------------------------------------------------------------------------------------------------
def check_compatible(ref: IterationFile, tgt: IterationFile) -> None:
    """Raise FormatError when the files record different models or different parameters."""
    model_ref, model_tgt = ref.meta.get("model"), tgt.meta.get("model")
    if _model_id(model_ref) != _model_id(model_tgt):
        raise FormatError(
            f"'{ref.path}' records model '{model_ref}' but '{tgt.path}' records '{model_tgt}': "
            "compare two recordings of the same model"
        )
    for which in (STATE_BEFORE, STATE_AFTER):
        names_ref, names_tgt = set(ref.state(which)), set(tgt.state(which))
        if names_ref and names_tgt and names_ref != names_tgt:
            only_ref, only_tgt = sorted(names_ref - names_tgt), sorted(names_tgt - names_ref)
            example = (only_ref or only_tgt)[0]
            raise FormatError(
                f"'{ref.path}' and '{tgt.path}' hold different parameters ({len(only_ref)} only in the reference, "
                f"{len(only_tgt)} only in the target, e.g. '{example}'): not recordings of the same model"
            )


def check_replay(ref: IterationFile, tgt: IterationFile) -> Optional[str]:
    """A replay must start where the reference started: same optimizer, batch, state_before and (when it loaded
    one) optimizer state (bitwise, after the cast to the target's dtype when it ran in another one). Raise
    FormatError ("bad replay") when it did not — its
    rows would compare two different iterations; return a note when the target is no replay at all."""
    if not tgt.meta.get("replay_of"):
        return (f"'{tgt.path}' is not a replay (recorded without --replay): its weights, batch and random values are "
                f"its own, so entries may differ from the batch on; record the target with --replay {ref.path}")
    # the optimizers' class names: two that `record --optimizer` builds and that differ are a replay run with the
    # other option; a class of the model's own (a vendor's AdamW against torch's) is what the optimizer rows judge
    opt_ref, opt_tgt = str(ref.meta.get("optimizer") or ""), str(tgt.meta.get("optimizer") or "")
    if opt_ref in OPTIMIZERS and opt_tgt in OPTIMIZERS and opt_ref != opt_tgt:
        raise FormatError(f"bad replay: the reference ran optimizer '{opt_ref}', the target '{opt_tgt}': a replay "
                          f"must run the reference's optimizer (record --optimizer {opt_ref})")
    ref_batch, tgt_batch = ref.batch_paths(), tgt.batch_paths()
    if len(ref_batch) != len(tgt_batch):
        raise FormatError(f"bad replay: the reference's batch has {len(ref_batch)} tensors, the target's "
                          f"{len(tgt_batch)}: the target did not run on the reference's batch")
    pairs = list(zip(ref_batch, tgt_batch, strict=True))  # lengths checked equal above
    state_ref, state_tgt = ref.state(STATE_BEFORE), tgt.state(STATE_BEFORE)
    pairs += [(state_ref[name], state_tgt[name]) for name in state_ref if name in state_tgt]
    if tgt.meta.get(OPTIMIZER_STATE) == LOADED:  # the optimizer's state it loaded is the reference's too
        state_opt_ref, state_opt_tgt = ref.state(OPTIMIZER), _as_reference_names(tgt)
        grouped = _kept_in_groups(tgt)  # the target keeps these in its param groups: no dataset to compare
        state_opt_ref = {name: path for name, path in state_opt_ref.items()
                         if (split_optimizer_entry(name) or ("", ""))[1] not in grouped}
        missing = sorted(set(state_opt_ref) - set(state_opt_tgt))
        if missing:
            raise FormatError(f"bad replay: the target's optimizer holds no '{missing[0]}' after loading the "
                              f"reference's state ({len(missing)} of {len(state_opt_ref)} values missing): its "
                              f"update cannot start where the reference's did")
        pairs += [(state_opt_ref.get(name, ""), path) for name, path in state_opt_tgt.items()]
    for ref_path, tgt_path in pairs:
        if not ref_path or not same_start(ref, tgt, ref_path, tgt_path):
            raise FormatError(
                f"bad replay: the target's {tgt_path} differs from the reference's, so it did not start from this "
                f"reference's weights and batch (was it replayed from another file? its replay_of is "
                f"'{tgt.meta.get('replay_of')}'); record the target again with --replay {ref.path}")
    return None


def _as_reference_names(tgt: IterationFile) -> dict[str, str]:
    """The target's `/optimizer_state` entries by the reference's names: a target optimizer that keeps the same
    quantities under other names says which (`STATE_NAMES`, `record/start/state_names.py`)."""
    try:
        names = json.loads(str(tgt.meta.get(STATE_NAMES) or "{}"))
    except ValueError:
        names = {}
    found = {}
    for entry, path in tgt.state(OPTIMIZER).items():
        param, key = split_optimizer_entry(entry) or (entry, "")
        found[optimizer_entry(param, names.get(key, key)) if key else entry] = path
    return found


def _kept_in_groups(tgt: IterationFile) -> set[str]:
    """The reference's state keys the target's optimizer keeps in its param groups (`group:<key>` in STATE_NAMES)."""
    try:
        names = json.loads(str(tgt.meta.get(STATE_NAMES) or "{}"))
    except ValueError:
        return set()
    return {key for where, key in names.items() if where.startswith("group:")}


def same_start(ref: IterationFile, tgt: IterationFile, ref_path: str, tgt_path: str) -> bool:
    """Whether the target's copy of a reference tensor is the reference's, bit for bit (cast to the target's dtype
    when it differs; statistics files by checksum)."""
    if ref.shape_of(ref_path) != tgt.shape_of(tgt_path):
        return False
    dtype_ref, dtype_tgt = ref.dtype_of(ref_path), tgt.dtype_of(tgt_path)
    if tgt.is_stats(tgt_path) or ref.is_stats(ref_path):
        if dtype_ref != dtype_tgt:
            return True  # a checksum of another dtype proves nothing either way
        mine, theirs = ref.stats_of(ref_path), tgt.stats_of(tgt_path)
        return mine.kind == theirs.kind and mine.checksum == theirs.checksum
    if dtype_ref == dtype_tgt:
        a, b = ref.raw(ref_path), tgt.raw(tgt_path)
        return a.dtype == b.dtype and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                     np.ascontiguousarray(b).view(np.uint8))
    import torch

    cast = ref.tensor(ref_path).to(getattr(torch, dtype_tgt))
    mine = tgt.tensor(tgt_path)
    if cast.dtype != mine.dtype:
        return False
    return bool(cast.view(torch.uint8).equal(mine.contiguous().view(torch.uint8)))


def _model_id(spec) -> str:
    """A model's identity across machines: a built-in name, or `file.py:function` without the file's folder."""
    text = str(spec or "")
    path, sep, func = text.rpartition(":")
    return f"{os.path.basename(path)}:{func}" if sep and path.endswith(".py") else text


def hidden(pairs: list, ref: IterationFile, tgt: IterationFile) -> tuple[list, Optional[dict]]:
    """The pairs to compare, and what each side compiled: an entry one side holds of a call that runs inside a
    compiled block of the other side (whose modules there run inside its graph, unhooked) is left out and
    counted per block; never a structural difference."""
    sides = {"reference": ref.compiled(), "target": tgt.compiled()}
    if not any(sides.values()):
        return pairs, None
    blocks = {side: dict(info.get("blocks") or {}) for side, info in sides.items()}
    kept: list = []
    hidden: dict[tuple, dict[str, Any]] = {}  # (side lacking the entries, block) -> what it lacks
    for pair in pairs:
        lacking = "target" if pair[1] is None else "reference" if pair[0] is None else None
        entry = pair[0] or pair[1]
        block = None
        if lacking is not None and entry.phase in ("forward", "backward"):
            block = next((b for b in blocks[lacking] if _inside(entry.module, b)), None)
        if block is None:
            kept.append(pair)
            continue
        count = hidden.setdefault((lacking, block), {"side": lacking, "block": block, "entries": 0, "calls": set()})
        count["entries"] += 1
        count["calls"].add((entry.module, entry.call))
    gone = [{**h, "calls": len(h["calls"])} for h in hidden.values()]
    return kept, {**{side: info for side, info in sides.items() if info}, "hidden": gone}


def _inside(module: str, block: str) -> bool:
    """Whether the call of `module` (a file's module name, `(root)` the model) runs strictly inside `block`."""
    return module != ROOT_MODULE and module != block and (block == "" or module.startswith(block + "."))
