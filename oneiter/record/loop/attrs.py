"""A Recorder's file's root attributes (docs/format.md), as the block starts: the model, its device and dtypes,
the optimizers and where they start, the environment, and what the recording was asked to do."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from oneiter.format.optimizer_state import OPTIMIZER_STATE
from oneiter.format.schema import GRAD_REDUCTION, OPTIMIZER_CLASS, PRECISION_MODES, STATE_NAMES
from oneiter.record.loop.given import optimizer_names, param_dtype
from oneiter.record.options import RecordOptions
from oneiter.record.start.state_names import qualified, renamed
from oneiter.runtime import precision_modes
from oneiter.runtime.devices import device_name
from oneiter.runtime.sharding import class_name, reduction
from oneiter.version import __version__

__all__ = ["file_attrs"]


def file_attrs(model, opts: RecordOptions, *, ref, device, optimizers: list, optimizer_start: str, rank,
               modes, replay: Path | None, local_kind: str) -> dict[str, Any]:
    """The file's root attributes; `opts.meta` entries override these. `modes`: the precision modes in force."""
    import torch

    dtype = param_dtype(model)
    # a replay is of the reference's model: its name (and how it was built) unless told otherwise
    ref_meta = ref.meta if ref is not None else {}
    meta = {
        "model": opts.name or ref_meta.get("model") or class_name(model),
        "model_args": ref_meta.get("model_args") or "{}", "batch_size": ref_meta.get("batch_size") or 0,
        "seed": opts.seed if opts.seed is not None else -1, "rng_seed": opts.seed,
        "device": str(device), "device_type": device.type, "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "float32", "amp": opts.amp,
        "float8": opts.float8 or "",
        "optimizer": optimizer_names(optimizers), OPTIMIZER_STATE: optimizer_start,
        OPTIMIZER_CLASS: ",".join(qualified(o) for o in optimizers),
        "num_threads": torch.get_num_threads(), "torch_version": str(torch.__version__),
        "oneiter_version": __version__, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "replay_of": str(replay) if replay is not None else None,
        "include": json.dumps(opts.include), "exclude": json.dumps(opts.exclude), "faults": "[]",
        "fallback": json.dumps(opts.fallback),
        "random_replay": bool(replay is not None and opts.random_replay),
        "rank": rank.rank, "world_size": rank.world_size, "level": opts.level,
        PRECISION_MODES: precision_modes.to_attr(modes),
        GRAD_REDUCTION: reduction(model, rank.world_size),  # until backward shows a reducer
    }
    names = {k: v for o in optimizers for k, v in renamed(o).items()}
    if names:  # the target's optimizer keeps the reference's state under other names (`state_names.py`)
        meta[STATE_NAMES] = json.dumps(names, sort_keys=True)
    meta.update(opts.meta)
    meta["local"] = local_kind
    return meta
