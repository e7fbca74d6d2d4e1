"""The optimizer's state when a recorded step begins: what a recording stores of it, and what a replay loads.

Where this sits: the Recorder calls `start_entries` when its block begins (the values go to `/optimizer_state`,
named `<parameter>.<key>`: `format/schema.py`; the root attribute `optimizer_state` says what they are:
`format/optimizer_state.py`) and, replaying, `load_start` right after it loaded the reference's weights, so a step
recorded after others (AdamW's moments and step count, SGD's momentum) starts from the reference's state and its
update is judged like the first step's. The faithful copy of the optimizer that the teacher-forced probe steps
(`record/local/optimizer_rows.py`) copies the loaded state with the rest of the optimizer.

What is stored: every tensor value of every parameter's state (`step`, `exp_avg`, `momentum_buffer`, ...), as the
optimizer holds it. A state oneiter cannot store makes the attribute `not recorded` (updates then not judged, and
said why): a value that is not a tensor or None, a sharded (FSDP2) one, a key that is not an identifier, a
parameter that is not the model's.

Loading goes through the optimizer's own `load_state_dict` (torch casts each floating value to its parameter's
dtype and device, and keeps `step` as it is), with the target's own param groups: its options (learning rate,
betas) stay its code's, only the state is the reference's. A target optimizer of another class that keeps the same
quantities under other names or in its param groups (apex's FusedAdam: the step count in `group['step']`) gets them
where it keeps them (`state_names.py`), or the replay is refused in one line before its step runs.
"""

from __future__ import annotations

from collections import defaultdict

from oneiter.errors import OneIterError
from oneiter.format.optimizer_state import EMPTY, LOADED, NOT_RECORDED, OPTIMIZER_STATE, RECORDED, state_of
from oneiter.format.schema import OPTIMIZER, OPTIMIZER_CLASS, optimizer_entry, split_optimizer_entry
from oneiter.record.start.state_names import GROUP, plan, remember
from oneiter.runtime.names import canonical
from oneiter.runtime.sharding import is_dtensor

__all__ = ["start_entries", "load_start"]


def start_entries(optimizers, model) -> tuple[list[tuple[str, object]], str]:
    """(entries, value): the state of `optimizers` as (`<parameter>.<key>`, tensor) pairs to store, and the file's
    `optimizer_state` value ("" without optimizers, `empty`, `recorded`, or `not recorded` with no entries)."""
    import torch

    if not optimizers:
        return [], ""
    names = {id(p): canonical(n) for n, p in model.named_parameters(remove_duplicate=False)}
    entries: list[tuple[str, object]] = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p) if hasattr(opt.state, "get") else None
                if not state:
                    continue
                name = names.get(id(p))
                if name is None:
                    return [], NOT_RECORDED
                for key, value in state.items():
                    if value is None:
                        continue
                    entry = optimizer_entry(name, str(key))
                    if not isinstance(value, torch.Tensor) or is_dtensor(value) or split_optimizer_entry(entry) != (
                            name, key) or value.is_sparse:
                        return [], NOT_RECORDED
                    entries.append((entry, value))
    return entries, RECORDED if entries else EMPTY


def load_start(optimizers, model, ref) -> str:
    """Give `optimizers` the state the reference's recorded at the start of its step (an empty one included: a
    replay starts from the reference's state, not from what the target's optimizer held); returns the target's
    `optimizer_state` value. A reference that holds no state (`not recorded`, older files) leaves them as they
    are: their value is then what they hold (`empty` or `not recorded`)."""
    if not optimizers:
        return ""
    theirs = str(ref.meta.get(OPTIMIZER_STATE) or "")
    if theirs not in (EMPTY, RECORDED, LOADED):
        return state_of(optimizers)
    recorded = _read(ref) if theirs != EMPTY else {}
    owners = {}
    names = {id(p): canonical(n) for n, p in model.named_parameters(remove_duplicate=False)}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in names:
                    owners[names[id(p)]] = (opt, p)
    for name, values in recorded.items():
        if name not in owners:
            raise OneIterError(f"the reference '{ref.path.name}' holds optimizer state for '{name}', which no "
                               f"optimizer of this run steps: a replay needs the reference's optimizer",
                               param="optimizer")
        _check_shapes(name, values, owners[name][1], ref)
    classes = str(ref.meta.get(OPTIMIZER_CLASS) or "").split(",")
    for index, opt in enumerate(optimizers):
        mine = {name: values for name, values in recorded.items() if owners[name][0] is opt}
        keys = {key for values in mine.values() for key in values}
        where = plan(opt, classes[index] if len(classes) == len(optimizers) else classes[0], keys) if keys else {}
        remember(opt, where)
        _load(opt, {name: {where[k]: v for k, v in values.items() if not where[k].startswith(GROUP)}
                    for name, values in mine.items()}, names)
        _load_groups(opt, {name: {where[k][len(GROUP):]: v for k, v in values.items() if where[k].startswith(GROUP)}
                           for name, values in mine.items()}, names)
    return LOADED if recorded else EMPTY


def _load_groups(opt, values: dict[str, dict], names: dict[int, str]) -> None:
    """The quantities `opt` keeps in its param groups (apex's FusedAdam: `step`), from the reference's per-parameter
    values, which must agree within each group; a whole number as an int."""
    for group in opt.param_groups:
        found: dict[str, set] = {}
        for p in group["params"]:
            for key, value in values.get(names.get(id(p), ""), {}).items():
                number = float(value.reshape(-1)[0]) if value.numel() == 1 else None
                found.setdefault(key, set()).add(int(number) if number is not None and number.is_integer() else number)
        for key, seen in found.items():
            if len(seen) != 1 or None in seen:
                raise OneIterError(f"the reference's optimizer state holds several values of '{key}' for one param "
                                   f"group of the target's {type(opt).__name__}, which keeps one per group: a "
                                   f"replay cannot load it", param="optimizer")
            group[key] = seen.pop()


def _read(ref) -> dict[str, dict[str, object]]:
    """parameter name -> {key: tensor} of the reference's `/optimizer_state`, on the CPU, bit for bit."""
    values: dict[str, dict[str, object]] = defaultdict(dict)
    for entry in ref._names_in(OPTIMIZER):
        split = split_optimizer_entry(entry)
        assert split is not None  # checked on open (`format/validate.py`)
        param, key = split
        path = f"{OPTIMIZER}/{entry}"
        if ref.is_stats(path):
            raise OneIterError(f"the reference '{ref.path.name}' holds only statistics of its optimizer's state "
                               f"('{entry}'): replay a recording whose start is stored in full", param="replay")
        values[param][key] = ref.tensor(path).clone()  # its own memory: the optimizer updates it in place
    return dict(values)


def _check_shapes(name: str, values: dict, param, ref) -> None:
    """Every state value of more than one element has the parameter's shape (torch's per-parameter optimizers)."""
    for key, value in values.items():
        if value.numel() > 1 and tuple(value.shape) != tuple(param.shape):
            raise OneIterError(f"the reference '{ref.path.name}' holds optimizer state '{name}.{key}' of shape "
                               f"{list(value.shape)}, but '{name}' has shape {list(param.shape)} here",
                               param="replay")


def _load(opt, values: dict[str, dict], names: dict[int, str]) -> None:
    """`opt`'s state becomes `values` (by parameter name; `names`: id -> name), through its own
    `load_state_dict` with its own param groups."""
    own = opt.state_dict()
    params = [p for group in opt.param_groups for p in group["params"]]
    ids = [i for group in own["param_groups"] for i in group["params"]]
    state = {i: dict(values[names[id(p)]]) for p, i in zip(params, ids, strict=True)
             if names.get(id(p)) in values}
    opt.load_state_dict({"state": state, "param_groups": own["param_groups"]})
