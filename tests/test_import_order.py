"""oneiter's own imports go one way, down this table, like huggingface_hub's `check_static_imports`.

    rank  layer         what it is
    0     errors        typed errors, the version, where outputs go and how numbers are written (errors.py,
                        version.py, outputs.py, formatting.py): leaves, torch-free
    1     models        the built-in models (pure torch modules)
    2     runtime       what an iteration runs on: model specs, training step, devices, precision, ranks
    3     format        the recording on disk: schema, file, validation, statistics
    4     record        one iteration recorded (and replayed); imports runtime, format
    4     profile       torch.profiler runs; imports errors, runtime and format only
    5     judge         two recordings judged
    6     report        a result shown
    7     cli, integrations, top (oneiter/__init__.py, api.py, demo.py, __main__.py): the entry points

A module may import its own layer and any layer of a lower rank (profile: only those it lists). Layers that share
a rank do not import each other (record and profile), except at the top, where the entry points call one another
(`python -m oneiter` runs the CLI, the CLI calls the API).

Inside `record/` and `judge/` the same rule holds between their parts (`SUBLAYERS`: a subpackage, or a module at the
package's top); a package's `__init__.py` (its map, and what it re-exports) sits above all of its parts:

    record   0 capture  1 modes  2 options  3 start  4 local  5 session, replay, impact, loop  6 recorder  7 steps
             8 run
    judge    0 measure  1 iteration  2 stepwise, replayed

And no file imports itself through others: the graph of file-level imports (every import, as above) has no cycle.

Every import counts, wherever it is: at module top, inside a function, and under `if TYPE_CHECKING:` too, since
an annotation that names an upper layer's type is the same dependency, only hidden.

Imports of oneiter's own modules go at module top. An import inside a function is kept only where it is listed in
`LAZY` with its reason: keeping `import oneiter` and `oneiter --help` free of torch and fast, an optional
extension, or an import whose cost only some calls should pay.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from conftest import load_tool

imports = load_tool("imports").imports  # (line, imported oneiter module, inside a function) of a module's code

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "oneiter"

RANKS = {"errors": 0, "models": 1, "runtime": 2, "format": 3, "record": 4, "profile": 4, "judge": 5, "report": 6,
         "cli": 7, "integrations": 7, "top": 7}
TOP_RANK = 7
ONLY = {"profile": {"errors", "runtime", "format"}}  # the lower layers a layer may import, where not all of them
# top-level modules in the errors layer; the other top-level modules are `top`
LEAVES = {"errors", "version", "outputs", "formatting"}

# (file pattern, imported module) -> why it stays inside a function; the module matches itself and its submodules
LAZY = {
    # the entry points import their work on first use: `import oneiter`, `oneiter --help` stay torch-free and fast
    # (oneiter/__init__.py loads its public API with importlib.import_module, which is not an import statement)
    ("oneiter/cli/*.py", "oneiter"): "each command imports its work when it runs, for `oneiter --help`'s startup",
    # optional or costly, for only some calls
    ("oneiter/format/stats.py", "oneiter.format._statskernel"): "the C kernel is optional (built when a C compiler "
                                                                "is there at install)",
    ("oneiter/runtime/modelspec.py", "oneiter.models"): "the built-in models' registry imports mmengine (~0.6 s): "
                                                        "paid only when a built-in model is named",
    ("oneiter/runtime/commands.py", "oneiter.models"): "the built-in models' registry imports mmengine (~0.6 s): "
                                                       "paid only when a verdict names a step to record",
    # `oneiter.Recorder` (and the options it takes) load without torch: what needs torch loads when a block runs
    ("oneiter/record/loop/entry.py", "oneiter.record.local.probe"): "imports torch; loaded when a block replays",
    ("oneiter/record/modes/active.py", "oneiter.record.modes.fallback"): "imports torch; loaded only with fallback=",
    ("oneiter/record/modes/active.py", "oneiter.record.modes.randomness"): "imports torch; loaded when a block starts",
    ("oneiter/record/modes/active.py", "oneiter.record.modes.collectives"): "imports torch; loaded when a block starts",
    ("oneiter/record/recorder.py", "oneiter.record.impact"): "imports torch; loaded only with impact=",
    ("oneiter/record/options.py", "oneiter.record.modes.fallback"): "imports torch; only fallback= patterns need it",
}


# parts of a package -> rank, inside the package (see the module docstring); a part not listed fails the test
SUBLAYERS = {
    "record": {"capture": 0, "modes": 1, "options": 2, "start": 3, "local": 4, "session": 5, "replay": 5,
               "impact": 5, "loop": 5, "recorder": 6, "steps": 7, "run": 8},
    "judge": {"measure": 0, "iteration": 1, "stepwise": 2, "replayed": 2},
}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under `oneiter` (`oneiter.format.schema` -> `format`)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "errors" if parts[1] in LEAVES else "top"


def allowed(source: str, target: str) -> bool:
    """Whether layer `source` may import layer `target` (see the module docstring)."""
    if source == target:
        return True
    if RANKS[source] == RANKS[target]:
        return RANKS[source] == TOP_RANK
    return RANKS[target] < RANKS[source] and target in ONLY.get(source, RANKS)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        yield rel.as_posix(), ".".join(rel.with_suffix("").parts), path.read_text(encoding="utf-8")


def sublayer_of(module: str) -> tuple[str, str] | None:
    """(package, part) of a module inside a package of `SUBLAYERS` (`oneiter.record.local.probe` -> (record, local);
    its `__init__` -> (record, "__init__")); None elsewhere."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] not in SUBLAYERS:
        return None
    return parts[1], parts[2]


def sub_allowed(source: tuple[str, str], target: tuple[str, str]) -> bool:
    """Whether part `source` of a package may import part `target` of the same package."""
    (package, here), (_, there) = source, target
    if here == there or here == "__init__":
        return True
    ranks = SUBLAYERS[package]
    return there != "__init__" and ranks[there] < ranks[here]


def order_violations(rel: str, module: str, source: str) -> list[str]:
    """One line per import of `source` that goes against the table, or against its package's `SUBLAYERS`."""
    here = layer_of(module)
    out = []
    for line, target, _ in imports(source, module):
        there = layer_of(target)
        if not allowed(here, there):
            out.append(f"{rel}:{line}: {here} (rank {RANKS[here]}) imports {target} ({there}, rank {RANKS[there]})")
            continue
        mine, theirs = sublayer_of(module), sublayer_of(target)
        if mine and theirs and mine[0] == theirs[0] and not sub_allowed(mine, theirs):
            ranks = SUBLAYERS[mine[0]]
            out.append(f"{rel}:{line}: {'/'.join(mine)} (rank {ranks.get(mine[1])}) imports {target} "
                       f"({'/'.join(theirs)}, rank {ranks.get(theirs[1])})")
    return out


def import_graph() -> dict[str, set[str]]:
    """Every oneiter module -> the oneiter modules its code imports (at top, in functions, under TYPE_CHECKING);
    a package as its `__init__`."""
    graph = {}
    for _, module, source in _modules():
        node = module.removesuffix(".__init__")
        graph[node] = {target for _, target, _ in imports(source, module)} - {node}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or through others (each sorted; one per cycle)."""
    reach = {node: reachable(graph, node) for node in graph}
    return sorted({tuple(sorted(m for m in reach[node] if node in reach.get(m, ()))) for node in graph
                   if node in reach[node]})


def _lazy_reason(rel: str, target: str) -> tuple | None:
    for pattern, prefix in LAZY:
        if fnmatch.fnmatch(rel, pattern) and (target == prefix or target.startswith(prefix + ".")):
            return pattern, prefix
    return None


def test_every_module_has_a_layer():
    assert {layer_of(m) for _, m, _ in _modules()} <= set(RANKS)
    parts = {sublayer_of(m) for _, m, _ in _modules()} - {None}
    unranked = sorted(f"{package}/{part}" for package, part in parts
                      if part != "__init__" and part not in SUBLAYERS[package])
    assert not unranked, f"parts of record/ or judge/ with no rank in SUBLAYERS (this file): {unranked}"


def test_no_import_cycle():
    """No file imports itself through others, type-only and function-level imports included."""
    found = cycles(import_graph())
    assert not found, "import cycles between files (break each: move the shared piece below both):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_imports_follow_the_layer_order():
    bad = [v for rel, module, source in _modules() for v in order_violations(rel, module, source)]
    assert not bad, "imports against the layer order (tests/test_import_order.py):\n" + "\n".join(bad)


def test_imports_of_oneiter_modules_are_at_module_top():
    used, bad = set(), []
    for rel, module, source in _modules():
        for line, target, in_function in imports(source, module):
            if in_function:
                entry = _lazy_reason(rel, target)
                if entry is None:
                    bad.append(f"{rel}:{line}: imports {target} inside a function")
                used.add(entry)
    assert not bad, "move these to module top, or list them in LAZY with the reason:\n" + "\n".join(bad)
    stale = sorted(set(LAZY) - used)
    assert not stale, f"LAZY entries no import needs any more (remove them): {stale}"


def test_the_checker_flags_what_it_should():
    """The checks themselves: an upward import (at top, in a function, under TYPE_CHECKING), a sideways one
    between record and profile, profile reaching past its list, a relative one; and what is fine."""
    upward = "import typing\nfrom oneiter.judge.measure.metrics import Metrics\n"
    assert order_violations("oneiter/format/x.py", "oneiter.format.x", upward) == [
        "oneiter/format/x.py:2: format (rank 3) imports oneiter.judge.measure.metrics (judge, rank 5)"]
    hidden = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from oneiter.report import terminal\n"
              "def f():\n    from oneiter.cli import main\n")
    assert [v.split(": ")[0] for v in order_violations("oneiter/judge/x.py", "oneiter.judge.x", hidden)] == [
        "oneiter/judge/x.py:3", "oneiter/judge/x.py:5"]
    assert order_violations("oneiter/record/x.py", "oneiter.record.x", "from oneiter.profile import trace\n")
    assert order_violations("oneiter/profile/x.py", "oneiter.profile.x", "from oneiter import models\n")
    assert order_violations("oneiter/runtime/x.py", "oneiter.runtime.x", "from .. import api\n")
    assert order_violations("oneiter/format/x.py", "oneiter.format.x", "from ..judge import engine\n")
    fine = ("from oneiter.errors import FormatError\nfrom oneiter.format.schema import call_key\n"
            "from . import stats\nfrom oneiter.runtime import devices\n")
    assert order_violations("oneiter/record/x.py", "oneiter.record.x", fine) == []
    assert order_violations("oneiter/cli/x.py", "oneiter.cli.x", "from oneiter import api, __version__\n") == []
    lazy = imports("def f():\n    from oneiter.format.layout import IterationFile\n", "oneiter.judge.x")
    assert lazy == [(2, "oneiter.format.layout", True)] and _lazy_reason("oneiter/judge/x.py", lazy[0][1]) is None
    # inside record/ and judge/: a lower part may not import a higher one, nor a part its sibling of the same rank
    down = "from oneiter.record.recorder import Recorder\n"
    assert order_violations("oneiter/record/local/x.py", "oneiter.record.local.x", down) == [
        "oneiter/record/local/x.py:1: record/local (rank 4) imports oneiter.record.recorder (record/recorder, rank 6)"]
    assert order_violations("oneiter/record/steps/x.py", "oneiter.record.steps.x", down) == []
    assert order_violations("oneiter/judge/stepwise/x.py", "oneiter.judge.stepwise.x",
                            "from oneiter.judge.replayed import op_verdict\n")
    assert order_violations("oneiter/judge/measure/x.py", "oneiter.judge.measure.x",
                            "if TYPE_CHECKING:\n    from oneiter.judge.iteration.blame import NoisePolicy\n")
    assert order_violations("oneiter/judge/x.py", "oneiter.judge.__init__",
                            "from oneiter.judge.stepwise import y\n") == []


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert cycles(graph) == [("a", "b", "c"), ("d", "e")]
    assert cycles({"a": {"b"}, "b": set()}) == []
