"""What a recording is asked to do, as one validated value: `RecordOptions`.

Every way into a recording builds one: `oneiter.Recorder` from its keywords, `record/run.py` (whose
`SpecOptions` adds what only a model spec needs), the Hugging Face callback and the mmengine hook (when they are
constructed, so a bad option fails before training starts). The checks live in `__post_init__`, once, and raise
`OneIterError`s that name the parameter (`amp must be one of bf16, fp16 ...`); the CLI rewrites that name into
its flag. Normalising is idempotent: `dataclasses.replace` re-validates a copy without changing what it holds.

This module stays free of torch at import: `import oneiter` and `oneiter.Recorder` must not import it.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, get_args

from oneiter.errors import OneIterError
from oneiter.format.writer import DEFAULT_QUEUE_BYTES
from oneiter.record.modes.float8 import RECIPES as FLOAT8_RECIPES

__all__ = ["RecordOptions", "Level", "Amp", "Calibration", "Against", "LEVELS", "CALIBRATIONS",
           "module_selector", "regex_list", "amp_name", "options_from", "keyword_signature"]

Level = Literal["full", "stats"]
Amp = Literal["bf16", "fp16"]
Calibration = Literal["cpu", "device"]
Against = Literal["cpu"]

LEVELS: tuple[str, ...] = get_args(Level)
CALIBRATIONS: tuple[str, ...] = get_args(Calibration)
# what `amp=` accepts for each autocast dtype: its short name, torch's name, and `str(torch.bfloat16)` (mmengine)
_AMP_TORCH_NAMES: tuple[tuple[Amp, str], ...] = (("bf16", "bfloat16"), ("fp16", "float16"))
_AMP_NAMES: dict[str, Amp] = {alias: short for short, long in _AMP_TORCH_NAMES
                              for alias in (short, long, f"torch.{long}")}


@dataclass(kw_only=True)
class RecordOptions:
    """The settings of one recording (not the live objects it records: model, optimizer, callbacks).

    A field's type is what it holds once checked; the constructor takes more where its docstring says so (a str
    path, `bfloat16`, `compile=True`, one regex for a list of them, None for a default), made so by `__post_init__`.
    """

    out: Path
    """The `.h5` file to write; never overwritten unless `force`."""
    replay: Path | None = None
    """A reference recording: its weights, buffers, batch and random values; every call judged against it."""
    amp: Amp | None = None
    """The run's autocast dtype; `bfloat16`, `torch.float16`, ... are accepted and stored as `bf16` / `fp16`."""
    include: list[str] = field(default_factory=list)
    """Regexes on module paths to record (all modules when empty); one string is one regex."""
    exclude: list[str] = field(default_factory=list)
    """Regexes on module paths not to record."""
    seed: int | None = 0
    """torch's, Python's and numpy's generators seeded with `seed` when the block starts, so dropout (and numpy's
    draws: SpecAugment masks) draw the same numbers (None: RNG left alone; `runtime/host_random.py`)."""
    isolate: bool = True
    """With `replay`: rerun every call teacher-forced on the reference's values (its local error)."""
    calibrate: Calibration = "cpu"
    """Where each call's expected noise is measured: the CPU (float64 vs the run's precision) or the device."""
    against: Against | None = None
    """"cpu": no reference; each call is judged against a float32 CPU recomputation of this run's values."""
    random_replay: bool = True
    """With `replay`: random ops take the reference's values."""
    fallback: list[str] = field(default_factory=list)
    """Regexes of aten ops run on the CPU in float32 (README: `--fallback`)."""
    force: bool = False
    """Overwrite `out` if it exists (never the file being replayed)."""
    name: str | None = None
    """The file's `model` attribute (default: the reference's on replay, else the model's class name)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """More root attributes of the file (JSON-able scalars); they override the Recorder's own."""
    manage_autocast: bool = True
    """Whether the Recorder enters autocast for `amp` (False when the training code enters it itself)."""
    skip: tuple[str, ...] = ()
    """Module paths never recorded, whatever `include` says (e.g. mmengine's data preprocessor)."""
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    """How many bytes of tensors may wait for the background writer before capture blocks (None or 0: the
    default, `format.writer.DEFAULT_QUEUE_BYTES`)."""
    level: Level = "full"
    """"full": every tensor's data; "stats": statistics and a checksum per tensor (`format.stats`; random values and
    -- unless this is a replay -- the batch and state_before stay full, so it can be replayed)."""
    compile: str | None = None
    """A torch.compile backend name (`inductor`; True means `inductor`): the model, or each module `compile_modules`
    matches, is compiled in place with it for the recording and left as it was after (`runtime/compiled.py`). A model
    that arrives compiled (torch.compile, `.compile()`) is recorded as it is, with or without this."""
    compile_modules: list[str] = field(default_factory=list)
    """With `compile`: regexes on module paths; each outermost matching module is compiled on its own (a block)."""
    float8: str | None = None
    """`tensorwise` / `rowwise`: the model's Linears converted to torchao's float8 training for the recording and
    converted back after it (`record/modes/float8.py`: those with dimensions divisible by 16, not the output
    projection; needs `pip install -c constraints.txt 'oneiter[float8]'`)."""
    impact: bool = False
    """With `replay`: after the recorded iteration, run it again from its start once per flagged call with that call
    fixed (its float64 recomputation on the trusted path), and once with all fixed: how much of the gap each fix
    closes (`record/impact/`, docs/impact.md; the iteration must be given as a function, `Recorder.run(fn)`)."""
    impact_top: int | None = None
    """With `impact`: fix at most this many flagged calls, largest own error first (None: every one)."""
    impact_from: Path | None = None
    """With `impact` over several steps (a replay of a multi-step reference): a one-iteration replay with per-call
    local error (the `--step S` replay the steps' comparison prints) whose flagged calls are fixed at every step."""

    def __post_init__(self) -> None:
        if not isinstance(self.out, (str, os.PathLike)):
            raise OneIterError(f"out must be a file path (str or PathLike), got {self.out!r}", param="out")
        self.out = Path(self.out)
        if self.replay is not None and not isinstance(self.replay, (str, os.PathLike)):
            raise OneIterError(f"replay must be a recording's path, got {self.replay!r}", param="replay")
        self.replay = Path(self.replay) if self.replay is not None else None
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise OneIterError(f"seed must be an int or None, got {self.seed!r}", param="seed")
        self._check_modes()
        self.include, self.exclude = regex_list(self.include, "include"), regex_list(self.exclude, "exclude")
        module_selector(self.include, self.exclude)
        self.fallback = list(self.fallback)
        if self.fallback:
            from oneiter.record.modes.fallback import compile_patterns  # imports torch: only when there is a fallback

            compile_patterns(self.fallback)
        self.amp = amp_name(self.amp)
        self.isolate, self.random_replay, self.force = bool(self.isolate), bool(self.random_replay), bool(self.force)
        self.manage_autocast = bool(self.manage_autocast)
        self.meta, self.skip = dict(self.meta or {}), tuple(self.skip)
        self.queue_bytes = self.queue_bytes or DEFAULT_QUEUE_BYTES
        self._check_compile()
        self._check_float8()
        self._check_impact()

    def _check_float8(self) -> None:
        """float8: one of torchao's recipes, and not with amp (the recipe quantizes from the model's own dtype)."""
        if self.float8 is None:
            return
        if self.float8 not in FLOAT8_RECIPES:
            raise OneIterError(f"float8 takes one of {', '.join(FLOAT8_RECIPES)} (torchao's float8 training "
                               f"recipes), got {self.float8!r}", param="float8")
        if self.amp is not None:
            raise OneIterError("float8 computes the converted Linears in float8 from the model's own dtype, and "
                               "autocast would recast their operands and scales: drop amp (for a bfloat16 model, "
                               "record with dtype bfloat16)", param="float8")

    def _check_impact(self) -> None:
        """impact: a full-level replay with its calls judged, not compiled; impact_top: an int >= 1, with impact."""
        top = self.impact_top
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise OneIterError(f"impact_top must be an integer >= 1 (how many flagged calls to fix), got {top!r}",
                               param="impact_top")
        self.impact = bool(self.impact)
        if top is not None and not self.impact:
            raise OneIterError("impact_top bounds how many calls impact fixes: give impact too", param="impact_top")
        if self.impact_from is not None:
            if not isinstance(self.impact_from, (str, os.PathLike)):
                raise OneIterError(f"impact_from must be a recording's path, got {self.impact_from!r}",
                                   param="impact_from")
            self.impact_from = Path(self.impact_from)
            if not self.impact:
                raise OneIterError("impact_from names the calls impact fixes: give impact too", param="impact_from")
        if not self.impact:
            return
        why = ("ranks the calls a replay flags: give replay too" if self.replay is None else
               "ranks the calls the replay's per-call judgement flags, which isolate off turns off"
               if not self.isolate else
               "needs each call's own error, which level stats does not measure" if self.level == "stats" else
               "cannot fix the calls inside compiled code one by one: drop compile" if self.compile else "")
        if why:
            raise OneIterError(f"impact {why}", param="impact")

    def _check_compile(self) -> None:
        """compile: a backend name (True: inductor); compile_modules: regexes, only with compile."""
        given: object = self.compile  # the field holds a name; True is taken as torch.compile's default
        if given is True:
            self.compile = "inductor"
        if self.compile is not None and (not isinstance(self.compile, str) or not self.compile.strip()):
            raise OneIterError(f"compile takes a torch.compile backend name such as 'inductor' (or True), got "
                               f"{self.compile!r}", param="compile")
        self.compile_modules = regex_list(self.compile_modules, "compile_modules")
        for pattern in self.compile_modules:
            try:
                re.compile(pattern)
            except re.error as err:
                raise OneIterError(f"compile_modules has a bad regular expression: {err}",
                                   param="compile_modules") from None
        if self.compile_modules and not self.compile:
            raise OneIterError("compile_modules chooses what compile compiles: give compile too (e.g. 'inductor')",
                               param="compile_modules")
        if self.compile and self.fallback:
            raise OneIterError("fallback moves single aten ops to the CPU, which compiled code does not run: drop "
                               "fallback or compile", param="fallback")

    def _check_modes(self) -> None:
        """against / calibrate / level, alone and together."""
        if self.against not in (None, *get_args(Against)):
            raise OneIterError(f"against takes 'cpu' (recompute each call on the CPU in float32), got "
                               f"{self.against!r}", param="against")
        if self.calibrate not in CALIBRATIONS:
            raise OneIterError(f"calibrate takes 'cpu' or 'device' (where each call's expected noise is measured), "
                               f"got {self.calibrate!r}", param="calibrate")
        if self.level not in LEVELS:
            raise OneIterError(f"level takes {' or '.join(LEVELS)}, got {self.level!r}", param="level")
        if self.level == "stats" and self.against:
            raise OneIterError("level='stats' keeps no tensor data, which against='cpu' reruns from", param="level")
        if self.against and self.replay is not None:
            raise OneIterError("against='cpu' needs no reference: drop replay, or drop against to compare with it",
                               param="against")

    def selector(self) -> Callable[[str], bool]:
        """Whether a module path is recorded: `include`/`exclude`, and never a path under `skip`."""
        chosen = module_selector(self.include, self.exclude)
        skipped = self.skip
        return lambda path: chosen(path) and not any(path == s or path.startswith(s + ".") for s in skipped)


def module_selector(include: Sequence[str], exclude: Sequence[str]) -> Callable[[str], bool]:
    """A predicate on module paths: matches any `include` regex (all if none) and no `exclude` regex."""
    patterns = {}
    for param, values in (("include", include), ("exclude", exclude)):
        try:
            patterns[param] = [re.compile(p) for p in values]
        except re.error as err:
            raise OneIterError(f"{param} has a bad regular expression: {err}", param=param) from None
    inc, exc = patterns["include"], patterns["exclude"]

    def select(path: str) -> bool:
        if inc and not any(p.search(path) for p in inc):
            return False
        return not any(p.search(path) for p in exc)

    return select


def regex_list(value, param: str) -> list[str]:
    """None, one regex string or a list of them, as a list (checked)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise OneIterError(f"{param} must be None, a regex string or a list of them, got {value!r}", param=param)


def amp_name(amp) -> Amp | None:
    """`amp` as "bf16" / "fp16" (None stays None); any other value is refused."""
    if amp is None:
        return None
    name = _AMP_NAMES.get(str(amp))
    if name is None:
        raise OneIterError(f"amp must be one of bf16, fp16 (or None), got {amp!r}", param="amp")
    return name


def options_from(owner: str, out, keywords: dict[str, Any]) -> RecordOptions:
    """`out` and the recording keywords `owner` (a class name, for errors) was given, as one checked `RecordOptions`;
    a keyword that is no field of it is refused as Python refuses one (`TypeError`)."""
    names = {f.name for f in fields(RecordOptions)} - {"out"}
    unknown = sorted(set(keywords) - names)
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument '{unknown[0]}'")
    return RecordOptions(out=out, **keywords)


def keyword_signature(function: Callable) -> inspect.Signature:
    """`function`'s signature with its `**options` spelled out: one keyword-only parameter per field of
    `RecordOptions` but `out`, with its default (what `help()` and `inspect.signature` show of `oneiter.Recorder`)."""
    own = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in own}
    settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type, default=_default(f))
                for f in fields(RecordOptions) if f.name not in taken]
    return inspect.Signature(own + settings)


def _default(f: Field) -> Any:
    """A field's default: its value, or what its factory makes (a fresh list or dict); none: a required keyword."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else inspect.Parameter.empty
