"""Compiled models and blocks (`torch.compile`): what oneiter sees of them, and how its own code stays outside them.

A *compiled block* is a module whose call runs code that torch.compile produced. A model arrives with blocks in three
forms, all found by `find_blocks`:
- `torch.compile(module)`: an `OptimizedModule` wrapper (`wrapper`), the module itself under `_orig_mod`;
- `module.compile()`: the module compiled in place (`in_place`: its `_compiled_call_impl` is set), names unchanged;
- `module.forward = torch.compile(module.forward)` (`forward`).
`compile_modules` makes blocks (`record --compile`, `Recorder(compile=...)`): the model, or each outermost module
whose path matches a regex, compiled in place with a registered backend (`check_backend`), undone afterwards.

What oneiter sees of a block: its call, from outside the compiled code — inputs, outputs, the gradients w.r.t. them
— and the parameters inside it (their gradients and updates). Modules inside a block run inside its graph: they are
*hidden* (`Blocks.hides`), never hooked, so no hook of oneiter is ever traced into a graph. `outside_call` attaches
hooks to a block where they run eagerly: an `OptimizedModule`'s own hooks already do (its `_orig_mod` is what is
compiled); an in-place compiled module's hooks are part of what torch compiles, so its compiled call is wrapped
instead. Every hook oneiter registers on a module is also marked for Dynamo to skip (`skipped`): a model called
from inside a compiled *function* (`torch.compile(train_step)`) breaks its graph there rather than tracing oneiter.

Names: `_orig_mod` is transparent — `eager_name` drops it from parameter, buffer and module names, so a compiled
model's names are its eager model's (the one place this mapping lives).

`CompileWatch` measures a recording's compilation: the seconds torch spent compiling (Dynamo's start/end callbacks,
a backward compiled lazily included), the graphs compiled per block, the graph breaks with their reason and the
user line where Dynamo broke the graph (its `graph_breaks` log, read while the watch runs), and the blocks Dynamo
ran eagerly after hitting a recompile limit (its warning). Reruns force compiled
code back to eager with `eager()` (`torch.compiler.set_stance("force_eager")`).

Nothing here imports torch._dynamo unless the model holds compiled code or compiling is asked for: importing it
costs seconds.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import time
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

from oneiter.errors import OneIterError
from oneiter.runtime.sharding import is_fsdp_hook

__all__ = ["WRAPPED", "eager_name", "Block", "Blocks", "find_blocks", "outside_call", "skipped", "skip_dispatch",
           "check_backend", "recordable_compiles", "RANDOM_THROUGH_ATEN", "random_lines",
           "compile_modules", "CompileWatch", "eager", "dynamo_loaded", "backend_name", "inductor_cache_dir"]

WRAPPED = "_orig_mod"  # where `torch.compile(module)` keeps the module it wraps


def eager_name(name: str) -> str:
    """A parameter, buffer or module name as the eager model has it: every `_orig_mod` segment dropped
    (`_orig_mod.0.weight` -> `0.weight`, `layers.1._orig_mod.mlp` -> `layers.1.mlp`, `_orig_mod` -> ``)."""
    if WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != WRAPPED)


def dynamo_loaded() -> bool:
    """Whether torch._dynamo is imported: without it nothing can be compiled (torch.compile imports it)."""
    return "torch._dynamo" in sys.modules


@dataclass
class Block:
    """One compiled block: `path` its eager module path, `raw` its path in `named_modules()` (with `_orig_mod`),
    `module` the module whose call oneiter hooks (the wrapper, or the module compiled in place), `kind` how it was
    compiled (`wrapper`, `in_place`, `forward`), `backend` the torch.compile backend's name."""

    path: str
    raw: str
    module: Any
    kind: str
    backend: str
    num_hidden: int = 0  # modules inside it, which oneiter cannot see
    eager: str = ""  # why torch.compile runs it eagerly after all ("": it runs compiled code)


@dataclass
class Blocks:
    """The compiled blocks of a model, by eager path (empty: an eager model)."""

    by_path: dict[str, Block] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_path)

    def hides(self, raw: str) -> bool:
        """Whether the module at `raw` (a `named_modules()` path) runs inside a block's compiled code."""
        return any(raw != b.raw and (b.raw == "" or raw.startswith(b.raw + ".")) for b in self.by_path.values())

    def around(self, path: str) -> Block | None:
        """The block an eager module path lies strictly inside (None: outside every block, or a block itself)."""
        for block in self.by_path.values():
            if path != block.path and (block.path == "" or path.startswith(block.path + ".")):
                return block
        return None

    def modules(self) -> dict[int, Block]:
        return {id(b.module): b for b in self.by_path.values()}


def find_blocks(model) -> Blocks:
    """The outermost compiled blocks of `model` (a block inside a block is hidden in it)."""
    found = Blocks()
    if not dynamo_loaded():
        return found
    from torch._dynamo.eval_frame import OptimizedModule

    for raw, module in model.named_modules():
        if found.hides(raw):
            found_in = next(b for b in found.by_path.values() if b.raw == "" or raw.startswith(b.raw + "."))
            found_in.num_hidden += int(not raw.endswith(WRAPPED))
            continue
        kind = _kind(module, OptimizedModule)
        if kind:
            path = eager_name(raw)
            found.by_path[path] = Block(path, raw, module, kind, backend_name(module, kind), eager=_eager(module, kind))
    return found


def _eager(module, kind: str) -> str:
    """Why torch.compile compiles nothing for a block, or "": `module.compile()` and `torch.compile(module.forward)`
    hand Dynamo a frame of torch.nn's own code (nn.Sequential, nn.Linear), which it skips (measured, torch 2.13)."""
    if kind == "wrapper":
        return ""  # torch.compile(module) wraps such a module in a frame Dynamo traces
    fn = module.__dict__.get("_compiled_call_impl" if kind == "in_place" else "forward")
    fn = getattr(getattr(fn, "compiled", fn), "_torchdynamo_orig_callable", None)
    if not inspect.ismethod(fn):
        return ""  # compiled through a frame of its own (oneiter's compile), which Dynamo traces
    from torch._dynamo import trace_rules

    # what Dynamo's frame runs: `_call_impl` calls the module's `forward` (an instance's own included)
    if not trace_rules.check(module.forward if kind == "in_place" else fn):
        return ""
    return (f"its forward is torch.nn's code ({type(module).__name__}), which torch.compile skips when it is "
            f"compiled this way: it ran eagerly (torch.compile(module), or oneiter's compile, compiles it)")


def _kind(module, optimized) -> str:
    if isinstance(module, optimized):
        return "wrapper"
    if module.__dict__.get("_compiled_call_impl") is not None:
        return "in_place"
    if hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"):
        return "forward"
    return ""


def backend_name(module, kind: str) -> str:
    """The name of the backend a block was compiled with (`inductor`, a registered name, a function's name)."""
    if kind == "wrapper":
        callback = getattr(module.dynamo_ctx, "callback", None)
    else:
        fn = module.__dict__.get("_compiled_call_impl") if kind == "in_place" else module.__dict__.get("forward")
        fn = getattr(fn, "compiled", fn)  # our own outside-call wrapper holds the compiled call
        callback = _closure_value(fn, "callback")
    seen = 0
    while callback is not None and seen < 16:
        for attr in ("compiler_name", "_compiler_name"):
            name = getattr(callback, attr, None)
            if isinstance(name, str) and name:
                return name
        inner = getattr(callback, "_torchdynamo_orig_backend", None)
        if inner is None:
            return str(getattr(callback, "__name__", "") or type(callback).__name__)
        callback, seen = inner, seen + 1
    return "unknown"


def _closure_value(fn, name: str):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or not fn.__closure__:
        return None
    try:
        return fn.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


# -- hooks that stay outside compiled code --------------------------------------------------------------------------
def skipped(fn: Callable) -> Callable:
    """`fn` marked for Dynamo to skip, when torch._dynamo is loaded (else `fn` itself): traced code that calls it
    breaks its graph there and runs it eagerly, with Dynamo off inside. A compiled module it calls still runs its
    compiled code (each compiled module turns Dynamo back on for itself: measured, torch 2.13)."""
    if not dynamo_loaded():
        return fn
    import torch

    return torch._dynamo.disable(fn)


def skip_dispatch(mode) -> None:
    """Once torch._dynamo is loaded, a dispatch mode's `__torch_dispatch__` is marked for Dynamo to skip (its class's,
    once): compiled code that falls back to eager Python under Dynamo (a graph break, a frame it skips) would
    otherwise compile the mode's own Python, op by op. Left alone before (the mark imports Dynamo: seconds)."""
    cls = type(mode)
    if not dynamo_loaded() or cls.__dict__.get("_oneiter_skipped"):
        return
    import torch

    raw = cls.__dict__.get("__torch_dispatch__")
    if raw is not None:
        cls.__torch_dispatch__ = torch._dynamo.disable(raw)
    cls._oneiter_skipped = True


class _OutsideCall:
    """Stands in for an in-place compiled module's `_compiled_call_impl`: runs oneiter's pre-hooks, the compiled call,
    then its post-hooks, all outside the compiled code (torch compiled the module's own hooks into the graph)."""

    def __init__(self, module, compiled):
        self.module, self.compiled = module, compiled
        self.pre: list[Callable] = []
        self.post: list[Callable] = []

    def __call__(self, *args, **kwargs):
        for hook in list(self.pre):
            result = hook(self.module, args, kwargs)
            if result is not None:
                args, kwargs = result
        output = self.compiled(*args, **kwargs)
        for hook in list(self.post):
            result = hook(self.module, args, kwargs, output)
            if result is not None:
                output = result
        return output


class _Handle:
    def __init__(self, undo: Callable[[], None]):
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


def outside_call(module, pre: Callable | None = None, post: Callable | None = None, *,
                 prepend: bool = False) -> list:
    """Forward pre/post hooks (`with_kwargs` signatures) on `module` that run outside any compiled code of it;
    returns handles with `remove()`."""
    pre = skipped(pre) if pre is not None else None
    post = skipped(post) if post is not None else None
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None:
        handles = []
        if pre is not None:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=prepend))
        if post is not None:
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        return handles
    outside = compiled if isinstance(compiled, _OutsideCall) else _OutsideCall(module, compiled)
    module.__dict__["_compiled_call_impl"] = outside
    handles = []
    for hooks, hook in ((outside.pre, pre), (outside.post, post)):
        if hook is not None:
            hooks.insert(0, hook) if prepend else hooks.append(hook)
            handles.append(_Handle(partial(_drop, module, outside, hooks, hook)))
    return handles


def _drop(module, outside: _OutsideCall, hooks: list, hook) -> None:
    hooks.remove(hook)
    if not outside.pre and not outside.post and module.__dict__.get("_compiled_call_impl") is outside:
        module.__dict__["_compiled_call_impl"] = outside.compiled


# -- compiling for a recording -------------------------------------------------------------------------------------
RANDOM_THROUGH_ATEN = "inductor's fallback_random"  # how compiled code drew its random numbers (the file says so)


@contextmanager
def recordable_compiles() -> Iterator[None]:
    """What code compiled inside the block must be for a recording of it, set while it compiles (a graph compiled
    before keeps what it was compiled with):

    - it draws its random numbers with the aten ops eager code runs (inductor's `fallback_random`: dropout is
      `aten.native_dropout`), which a replay hands the reference's values (`record/modes/randomness.py`), not with
      inductor's own generator (seeds from `aten.randint`, then Philox in its kernels), which no replay reaches
      (the replay says so in one line); other backends run aten ops themselves (`aot_eager`) or draw as they draw;
    - its backward keeps no donated buffers (`torch._functorch.config.donated_buffer`): a rerun of a block that
      returns several tensors computed from one another (a loss and the logits it came from) backpropagates
      through the same graph twice (`record/local/rerunning/gradients.py`: `external_grads`)."""
    if not dynamo_loaded():
        yield
        return
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fallback_random=True), functorch_config.patch(donated_buffer=False):
        yield


def random_lines(info: dict, side: str) -> list[str]:
    """The line that says how the random ops a side's compiled code drew were drawn (and replayed), or none."""
    count = int(info.get("random_ops") or 0)
    if not count:
        return []
    whose = f"the {side}'s" if side else "the"
    return [f"compiled: {count} random op(s) in {whose} compiled code (dropout) drawn through aten ops "
            f"({info.get('random') or RANDOM_THROUGH_ATEN}), which oneiter records and a replay gives the "
            f"reference's values"]


# -- compiling on request -------------------------------------------------------------------------------------------
def check_backend(name: str) -> None:
    """Refuse, with one line, a backend torch.compile does not know (registered names and entry points count)."""
    if not isinstance(name, str) or not name:
        raise OneIterError(f"compile takes a torch.compile backend name (e.g. inductor), got {name!r}",
                           param="compile")
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend(name)
    except Exception:
        known = ", ".join(torch._dynamo.list_backends(exclude_tags=()))
        raise OneIterError(f"compile: torch.compile has no backend '{name}' (registered: {known}; a vendor's "
                           f"backend is registered when its package is imported)", param="compile") from None


def compile_modules(model, backend, patterns: list[str]) -> Callable[[], None]:
    """Compile `model` in place (no `patterns`), or each outermost module whose eager path matches one of the
    `patterns`, with `backend` (a registered name, checked; or a backend callable); returns the function that undoes
    it. A model that holds compiled code already is refused (it would be compiled twice)."""
    import torch

    if isinstance(backend, str) or not callable(backend):
        check_backend(backend)
    present = find_blocks(model)
    if present:
        where = next(iter(present.by_path))
        raise OneIterError(f"compile: the model is compiled already ({where or '(root)'} is a compiled block): "
                           f"drop compile, or return the eager model", param="compile")
    targets = _targets(model, patterns)
    settings = recordable_compiles()
    settings.__enter__()  # until `restore`: the blocks compile lazily, at their first call
    undo: list = []
    codes: dict[tuple, types.CodeType] = {}
    for module in targets:
        # an FSDP2 unit: its forward alone, so FSDP2's hooks run eagerly around it, as oneiter's do, and a rerun
        # leaves them out (`record/local/rerun.py`); any other module: its whole call, its own hooks included
        slot = "forward" if _manages_parameters(module) else "_compiled_call_impl"
        had = module.__dict__.get(slot, _ABSENT)
        call = module.forward if slot == "forward" else module._call_impl
        module.__dict__[slot] = torch.compile(_frame(module, codes, call), backend=backend)
        undo.append((module, slot, had))

    def restore() -> None:
        for module, slot, had in reversed(undo):
            if had is _ABSENT:
                module.__dict__.pop(slot, None)
            else:
                module.__dict__[slot] = had
        settings.__exit__(None, None, None)

    return restore


def _manages_parameters(module) -> bool:
    """Whether hooks of FSDP2 (`fully_shard`) gather and reshard the module's parameters around its forward."""
    return any(is_fsdp_hook(h) for h in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()))


_ABSENT = object()


def _frame(module, codes: dict, call: Callable) -> Callable:
    """The function whose frame Dynamo compiles for a block: it calls `call` (the module's call: its hooks and its
    forward; or its forward alone), so torch.nn's own classes compile too (`module.compile()` leaves nn.Sequential
    eager: Dynamo skips torch.nn's frames). Dynamo keeps compiled graphs, and counts recompilations against
    `recompile_limit` (8, past which it runs the frame eagerly), per code object: the blocks of one class and parameter
    shapes in one `codes` (one compiling) share a code object, so identical blocks share a graph, while others and
    later compilings get their own budget."""
    key = (type(module), tuple(tuple(p.shape) for p in module.parameters()), call.__name__)
    code = codes.get(key)
    if code is None:
        code = codes[key] = _template().__code__.replace(co_name=f"compiled_{type(module).__name__}")
    return types.FunctionType(code, _template.__globals__, code.co_name, None, (types.CellType(call),))


def _template() -> Callable:
    call: Callable = _ABSENT  # type: ignore[assignment]  # a cell: `_frame` gives each block its own

    def block(*args, **kwargs):
        return call(*args, **kwargs)

    return block


def _targets(model, patterns: list[str]) -> list:
    if not patterns:
        return [model]
    compiled = [re.compile(p) for p in patterns]
    chosen: list[tuple[str, Any]] = []
    for raw, module in model.named_modules():
        path = eager_name(raw)
        if any(path == p or p == "" or path.startswith(p + ".") for p, _ in chosen):
            continue
        if any(c.search(path) for c in compiled):
            chosen.append((path, module))
    if not chosen:
        first = next((eager_name(p) for p, _ in model.named_modules() if p), "(root)")
        raise OneIterError(f"compile_modules {patterns} match no module of the model (module paths look like "
                           f"'{first}')", param="compile_modules")
    return [module for _, module in chosen]


# -- watching compilation -------------------------------------------------------------------------------------------
_LIMIT = re.compile(r"torch\._dynamo hit config\.(?P<limit>\w+) \((?P<value>\d+)\)\s*\n"
                    r"\s*function: (?P<function>[^\n]*)")
_LIMIT_LOGGER = "torch._dynamo.convert_frame"
_BREAK = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)\s*\n\s*Graph Break Reason: (?P<reason>.*)", re.S)
_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_WRAPPING = "Encountered graph break when attempting to trace"  # Dynamo's line before the reason of a nested break


class _BreakLog(logging.Handler):
    """Dynamo's graph-break log records, each as {block, where (file:line), reason (its first line)}, once each:
    a break inside an inlined call is logged again by each frame it breaks."""

    def __init__(self, where: Callable[[], str | None]):
        super().__init__(logging.DEBUG)
        self.where = where
        self.found: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a record we cannot format is no graph break we can place
            return
        match = _BREAK.search(text)
        if match is None:
            return
        lines = [line.strip() for line in match["reason"].splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].startswith(_WRAPPING):
            lines = lines[1:]
        found = {"block": self.where(), "where": f"{match['file']}:{match['line']}",
                 "reason": (lines[0] if lines else "")[:300]}
        if found not in self.found:
            self.found.append(found)


class _LimitLog(logging.Handler):
    """Dynamo's warning that a frame hit a recompile limit (it then runs that frame eagerly): {block, limit,
    function}, for the block whose call was open."""

    def __init__(self, where: Callable[[], str | None], rerun: Callable[[], bool]):
        super().__init__(logging.WARNING)
        self.where, self.rerun = where, rerun
        self.found: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            match = _LIMIT.search(record.getMessage())
        except Exception:  # a record we cannot format says nothing we can use
            return
        if match is not None:
            self.found.append({"block": self.where(), "limit": f"{match['limit']} ({match['value']})",
                               "function": match["function"].strip(), "rerun": self.rerun()})


class CompileWatch:
    """While active: the seconds torch spends compiling, the graphs compiled and the graph breaks, each put on the
    block whose call is open then (`where()`, a block's eager path, or None) and apart for reruns (`rerun()` True:
    a probe's rerun is running). A no-op when torch._dynamo is not loaded when it starts."""

    def __init__(self, where: Callable[[], str | None] = lambda: None, rerun: Callable[[], bool] = lambda: False):
        self.where, self.rerun = where, rerun
        self.seconds = 0.0  # compiling the iteration's own calls (forward and backward)
        self.rerun_seconds = 0.0  # compiling for the probes' reruns
        self.graphs: dict[str | None, int] = {}
        self.rerun_graphs = 0
        self.breaks: list[dict] = []
        self.limits: list[dict] = []  # recompile limits hit: those frames ran eagerly
        self._started: float | None = None
        self._graphs_before = 0
        self._active = False
        self._log: _BreakLog | None = None
        self._saved: tuple | None = None

    def __enter__(self) -> "CompileWatch":
        if not dynamo_loaded():
            return self
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        logger = logging.getLogger(_BREAK_LOGGER)
        self._saved = (logger.level, logger.disabled, logger.propagate)
        self._log = _BreakLog(self.where)
        logger.addHandler(self._log)
        if not logger.isEnabledFor(logging.DEBUG):  # not shown to the user (TORCH_LOGS=graph_breaks shows them)
            logger.setLevel(logging.DEBUG)
            logger.propagate = False
        logger.disabled = False
        self._limit_log = _LimitLog(self.where, self.rerun)
        logging.getLogger(_LIMIT_LOGGER).addHandler(self._limit_log)
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)
        logger = logging.getLogger(_BREAK_LOGGER)
        assert self._log is not None and self._saved is not None  # active: `__enter__` set them
        logger.removeHandler(self._log)
        logger.setLevel(self._saved[0])
        logger.disabled, logger.propagate = self._saved[1], self._saved[2]
        self.breaks = list(self._log.found)
        logging.getLogger(_LIMIT_LOGGER).removeHandler(self._limit_log)
        self.limits = list(self._limit_log.found)
        self._active = False

    def _start(self, _args) -> None:
        from torch._dynamo.utils import counters

        self._started = time.perf_counter()
        self._graphs_before = counters["stats"]["unique_graphs"]

    def _end(self, _args) -> None:
        from torch._dynamo.utils import counters

        if self._started is None:
            return
        seconds, self._started = time.perf_counter() - self._started, None
        graphs = counters["stats"]["unique_graphs"] - self._graphs_before
        if self.rerun():
            self.rerun_seconds += seconds
            self.rerun_graphs += graphs
            return
        self.seconds += seconds
        where = self.where()
        self.graphs[where] = self.graphs.get(where, 0) + graphs

    @property
    def total_seconds(self) -> float:
        return self.seconds + self.rerun_seconds


def inductor_cache_dir() -> str:
    """Where inductor keeps its compile cache (`TORCHINDUCTOR_CACHE_DIR`, else its default), "" when inductor is not
    loaded (no inductor compile ran)."""
    if "torch._inductor" not in sys.modules:
        return ""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # an older torch
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    return str(cache_dir())


@contextmanager
def eager() -> Iterator[None]:
    """Compiled code runs eagerly inside (a rerun that stands for the eager computation, in any precision)."""
    if not dynamo_loaded():
        yield
        return
    import torch

    stance = getattr(torch.compiler, "set_stance", None)
    with stance("force_eager") if stance is not None else nullcontext():
        yield
