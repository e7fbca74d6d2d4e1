"""The names of the CLI's flags, every one of them, and the command lines oneiter prints for a person to run next.

One place for both: the CLI declares each of its options with a `Flag` of this table (`cli/option_aliases.py`,
`cli/record_params.py` and the command modules; tests/cli/test_commands.py fails on an option declared with a
name of its own, and on a name here no command declares), and every verdict that says what to run next builds its
command here: two multi-step recordings' `record --step S` and `record --replay` (`judge/stepwise/step_verdict.py`),
`compare --drill`'s `replay --ops` (`judge/replayed/op_verdict.py`). The table sits here, below `judge/`, and not in
`cli/` because those verdicts print flag names and imports go one way (`cli` is above `judge`).
So a printed command names only flags the CLI has (tests/cli/test_commands.py parses each one with the CLI), and
renaming a flag is one line here.

Torch-free: `oneiter --help` imports this module.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, NamedTuple, Optional

from oneiter.runtime.modelspec import is_file_spec

__all__ = ["Flag", "MODEL", "DEVICE", "OUT", "BATCH_SIZE", "SEED", "DTYPE", "AMP", "THREADS", "MODEL_ARG", "OPTIMIZER",
           "REPLAY", "STEP", "STEPS", "INJECT_FAULT", "FALLBACK", "LAYER", "CALL", "OPS", "COMPILE", "COMPILE_MODULES",
           "FLOAT8", "IMPACT", "IMPACT_TOP", "IMPACT_FROM", "PARAMS", "INCLUDE", "EXCLUDE", "ISOLATE", "CALIBRATE",
           "AGAINST", "RANDOM_REPLAY", "LEVEL", "DATA_PARALLEL", "RTOL", "ATOL", "SHOW_ALL", "TOLERANCES", "JSON",
           "CSV", "HTML", "TENSORBOARD", "SUGGEST", "DRILL", "REPEAT", "REFERENCE_OPS", "REPRO", "SCHEDULE",
           "RECORD_SHAPES", "PROFILE_MEMORY", "WITH_STACK", "WITH_FLOPS", "MEMORY_SORT", "MODULE_RANGES", "OVERHEAD",
           "MAX_STEPS", "LIMIT", "SORT", "DEMO_DIR", "FAULT", "FORCE", "QUIET", "VERSION", "record_step_commands",
           "replay_ops_command", "model_arg_flags"]


class Flag(NamedTuple):
    """A command-line option: its long name, its one-letter alias where it has one, and the name that turns off
    an on/off option (`--no-isolate`)."""

    name: str
    short: Optional[str] = None
    off: Optional[str] = None

    @property
    def decls(self) -> tuple[str, ...]:
        """What `typer.Option(*flag.decls, ...)` declares."""
        first = self.name if self.off is None else f"{self.name}/{self.off}"
        return (first,) if self.short is None else (first, self.short)

    @property
    def brief(self) -> str:
        """How a printed command writes it: its one-letter alias where it has one, else its name."""
        return self.short or self.name


# the model, its run and its output (record, replay, profile, demo), and the flags the printed commands use
MODEL = Flag("--model", "-m")
DEVICE = Flag("--device", "-d")
OUT = Flag("--out", "-o")
BATCH_SIZE = Flag("--batch-size", "-b")
SEED = Flag("--seed")
DTYPE = Flag("--dtype")
AMP = Flag("--amp")
THREADS = Flag("--threads")
MODEL_ARG = Flag("--model-arg")
OPTIMIZER = Flag("--optimizer")
REPLAY = Flag("--replay")
STEP = Flag("--step")
STEPS = Flag("--steps")
INJECT_FAULT = Flag("--inject-fault")
FALLBACK = Flag("--fallback")
LAYER = Flag("--layer", "-l")
CALL = Flag("--call")
OPS = Flag("--ops")
COMPILE = Flag("--compile")
COMPILE_MODULES = Flag("--compile-modules")
FLOAT8 = Flag("--float8")
IMPACT = Flag("--impact")
IMPACT_TOP = Flag("--impact-top")
IMPACT_FROM = Flag("--impact-from")
# record's own
INCLUDE = Flag("--include")
EXCLUDE = Flag("--exclude")
ISOLATE = Flag("--isolate", off="--no-isolate")
CALIBRATE = Flag("--calibrate")
AGAINST = Flag("--against")
RANDOM_REPLAY = Flag("--random-replay", off="--no-random-replay")
LEVEL = Flag("--level")
DATA_PARALLEL = Flag("--data-parallel")
# compare's (--json also inspect's, replay's and profile diff's)
RTOL = Flag("--rtol")
ATOL = Flag("--atol")
SHOW_ALL = Flag("--all")
TOLERANCES = Flag("--tolerances")
JSON = Flag("--json")
CSV = Flag("--csv")
HTML = Flag("--html")
TENSORBOARD = Flag("--tensorboard")
SUGGEST = Flag("--suggest")
DRILL = Flag("--drill")
# replay's
REPEAT = Flag("--repeat", "-r")
REFERENCE_OPS = Flag("--reference-ops")
REPRO = Flag("--repro")
# profile's and profile diff's
SCHEDULE = Flag("--schedule", "-s")
RECORD_SHAPES = Flag("--record-shapes")
PROFILE_MEMORY = Flag("--profile-memory")
WITH_STACK = Flag("--with-stack")
WITH_FLOPS = Flag("--with-flops")
MEMORY_SORT = Flag("--memory-sort")
MODULE_RANGES = Flag("--module-ranges", off="--no-module-ranges")
OVERHEAD = Flag("--overhead", off="--no-overhead")
MAX_STEPS = Flag("--max-steps")
LIMIT = Flag("--limit")
SORT = Flag("--sort")
# demo's
DEMO_DIR = Flag("--dir")
FAULT = Flag("--fault")
# every writing command's, and the app's own
FORCE = Flag("--force")
QUIET = Flag("--quiet", "-q")
VERSION = Flag("--version")

PARAMS = {"faults": INJECT_FAULT.name, "replay": REPLAY.name, "out": OUT.name}
"""The library's parameter names whose CLI flag is not `--` + the name with dashes (`cli/common.py` rewrites an
error's parameter into its flag with it)."""


def record_step_commands(reference: dict[str, Any], target: dict[str, Any], ref_path: Path, tgt_path: Path,
                         step: int) -> Optional[list[str]]:
    """`oneiter record --step S` of the reference and `record --replay` of that file by the target, from the two
    recordings' metadata (`reference`, `target`: their first step's), writing beside them (`ref.h5` ->
    `ref.step6.h5`); None when the files do not say how the model was built (a built-in name or a model file:
    a Recorder in a user's own loop names neither)."""
    from oneiter import models  # the registry imports mmengine: only when a verdict names a step

    spec = str(reference.get("model") or "")
    if not (is_file_spec(spec) or spec in dict(models.list_models())):
        return None
    ref_out, tgt_out = _beside(ref_path, step), _beside(tgt_path, step)
    args = model_arg_flags(reference.get("model_args"))
    first = ["oneiter", "record", MODEL.name, spec, STEP.name, str(step), *_build(reference), *args, *_run(reference),
             OUT.brief, str(ref_out)]
    then = ["oneiter", "record", REPLAY.name, str(ref_out), MODEL.name, spec, *args, *_run(target), OUT.brief,
            str(tgt_out)]
    return [shlex.join(first), shlex.join(then)]


def replay_ops_command(reference: str, layer: str, call: int, *, device: str, dtype: Optional[str],
                       amp: Optional[str], model: Optional[str], compile: Optional[str] = None,
                       float8: Optional[str] = None) -> str:
    """`oneiter replay REF --layer L --call C --ops` on the target's device, dtype and autocast (`model`: the
    model spec to name, None: the recording's built-in one; `compile`: the torch.compile backend the target's
    block ran, None: not compiled; `float8`: the float8 recipe it converted its Linears to, None: none)."""
    words = ["oneiter", "replay", reference, LAYER.name, layer, CALL.name, str(call), OPS.name, DEVICE.name, device,
             *([DTYPE.name, dtype] if dtype else []), AMP.name, amp or "none", *([MODEL.name, model] if model else []),
             *([COMPILE.name, compile] if compile else []), *([FLOAT8.name, float8] if float8 else [])]
    return shlex.join(words)


def model_arg_flags(text: Any) -> list[str]:
    """`--model-arg KEY=VALUE` for each entry of a recording's `model_args` (JSON)."""
    try:
        values = json.loads(text or "{}")
    except ValueError:
        return []
    return [item for key, value in sorted(values.items()) for item in (MODEL_ARG.name, f"{key}={value}")]


def _build(meta: dict) -> list[str]:
    """How the reference built its model and batch: batch size, seed, optimizer."""
    out = []
    if meta.get("batch_size"):
        out += [BATCH_SIZE.name, str(meta["batch_size"])]
    if isinstance(meta.get("rng_seed"), int):
        out += [SEED.name, str(meta["rng_seed"])]
    if meta.get("optimizer") in ("sgd", "adamw"):
        out += [OPTIMIZER.name, str(meta["optimizer"])]
    return out


def _run(meta: dict) -> list[str]:
    """How a side ran: device, precision, threads, and (a target) its faults and op fallback."""
    out = [DEVICE.name, str(meta.get("device") or "cpu")]
    if meta.get("dtype") and meta["dtype"] != "float32":
        out += [DTYPE.name, str(meta["dtype"])]
    if meta.get("amp"):
        out += [AMP.name, str(meta["amp"])]
    if meta.get("float8"):
        out += [FLOAT8.name, str(meta["float8"])]
    if meta.get("num_threads"):
        out += [THREADS.name, str(meta["num_threads"])]
    for fault in _json_list(meta.get("faults")):
        out += [INJECT_FAULT.name, str(fault)]
    fallback = _json_list(meta.get("fallback"))
    if fallback:
        out += [FALLBACK.name, ",".join(map(str, fallback))]
    return out


def _json_list(text) -> list:
    try:
        value = json.loads(text or "[]")
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def _beside(path: Path, step: int) -> Path:
    """`ref.h5` -> `ref.step6.h5`, beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.step{step}{path.suffix or '.h5'}")
