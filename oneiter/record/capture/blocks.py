"""Compiled blocks as a recording sees them: what it refuses up front, and what it writes and says about them.

Where this sits: `runtime/compiled.py` finds a model's compiled blocks (torch.compile) and watches its compiling;
`ModuleCapture` hooks each block at its call (a compiled FSDP2 unit also with `gathered_through_call`). The
`Recorder` asks this module, once the hooks are attached, what a recording of those blocks cannot do (`refuse`), and
at its end for the file's `compiled` attribute (`compiled_attr`, docs/format.md) and the lines that tell the user
(`compiled_notes`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from oneiter.errors import OneIterError
from oneiter.format.schema import COMPILED, ROOT_MODULE
from oneiter.runtime.compiled import (
    RANDOM_THROUGH_ATEN,
    Blocks,
    CompileWatch,
    inductor_cache_dir,
    outside_call,
    random_lines,
)
from oneiter.runtime.sharding import GatheredThroughCall

__all__ = ["refuse", "gathered_through_call", "compiled_attr", "compiled_notes"]


def refuse(blocks: Blocks, *, fallback: bool, ref) -> None:
    """Refuse what a recording of compiled blocks cannot do: a torch without `set_stance` (reruns standing for
    eager code force it), op fallback, and replaying a reference (`ref`, or None) whose calls inside a block ran
    collectives (tensor parallelism): compiled code reduces other values than eager code (inductor folds a
    row-parallel layer's bias into the partial sums before its all-reduce), so the block's rerun cannot be handed
    the reference's results. Random numbers a block draws are replayed (`runtime/compiled.py`:
    `recordable_compiles`); a backend that draws its own is said when it draws (`record/modes/randomness.py`)."""
    if not blocks:
        return
    import torch

    first = next(iter(blocks.by_path)) or ROOT_MODULE
    if not hasattr(torch.compiler, "set_stance"):
        raise OneIterError(f"the model holds compiled code ({first}): recording it needs torch >= 2.6 "
                           f"(torch.compiler.set_stance), this is {torch.__version__}", param="model")
    if fallback:
        raise OneIterError(f"fallback moves single aten ops to the CPU, which the compiled code of {first} does "
                           f"not run: drop fallback", param="fallback")
    modules = {key: str(attrs.get("module") or "") for key, attrs in ref.calls()} if ref is not None else {}
    for _name, attrs in ref.collectives() if ref is not None else ():
        path = modules.get(str(attrs.get("call") or ""))
        block = None if path is None else (blocks.by_path.get(path) or blocks.around(path))
        if block is not None:
            raise OneIterError(
                f"the reference ran a collective ({attrs.get('op')}) in {path or ROOT_MODULE}, which runs inside the "
                f"compiled block {block.path or ROOT_MODULE} here: compiled code reduces other values than eager code "
                f"(inductor moves a row-parallel layer's bias into the partial sums), so the block's rerun cannot be "
                f"handed the reference's results; leave the modules that run collectives (tensor parallelism) "
                f"uncompiled (compile_modules)", param="compile")


def gathered_through_call(module, paused: Callable[[], bool]) -> list:
    """The handles of a compiled block that is an FSDP2 unit: its parameters stay gathered from its forward until its
    own rerun is done (`runtime/sharding.py`: `GatheredThroughCall`), hooked outside its compiled code, first before
    the call and last after it; nothing for any other block. `paused`: in a rerun, or in backward (recomputation)."""
    held = GatheredThroughCall(module, paused)
    if not held:
        return []
    return [*outside_call(module, held.before, prepend=True), *outside_call(module, post=held.after), held]


def compiled_attr(blocks: Blocks, watch: CompileWatch, random_ops: int = 0) -> dict[str, Any]:
    """{`compiled`: JSON} for the file: its blocks, what compiling cost, the graph breaks, the random ops their code
    drew and how (`random_ops`, `random`); {} when nothing was."""
    if not blocks and not watch.total_seconds:
        return {}
    graphs = dict(watch.graphs)
    eager = {path: b.eager for path, b in blocks.by_path.items()}
    for hit in watch.limits:  # Dynamo ran the block eagerly from then on: never passed off as compiled
        if hit["block"] in eager and not eager[hit["block"]]:
            during = " in a rerun" if hit["rerun"] else ""
            eager[hit["block"]] = (f"Dynamo hit its {hit['limit']} compiling {hit['function']}{during}: it ran "
                                   f"eagerly from then on (a block compiled many times in one process, or for many "
                                   f"shapes: raise torch._dynamo.config's limit)")
    info = {
        "blocks": {path: {"kind": b.kind, "backend": b.backend, "graphs": graphs.pop(path, 0),
                          "hidden_modules": b.num_hidden, "eager": eager[path]} for path, b in blocks.by_path.items()},
        "other_graphs": sum(graphs.values()), "graph_breaks": watch.breaks,
        "compile_seconds": round(watch.seconds, 3), "rerun_compile_seconds": round(watch.rerun_seconds, 3),
        "rerun_graphs": watch.rerun_graphs,
        "random_ops": int(random_ops), "random": RANDOM_THROUGH_ATEN if random_ops else "",
        "cache_dir": inductor_cache_dir() if any(b.backend == "inductor" for b in blocks.by_path.values()) else "",
    }
    return {COMPILED: json.dumps(info, sort_keys=True)}


def compiled_notes(attr: dict[str, Any]) -> list[str]:
    """The lines for the user: the compiled blocks, what they hide, their graphs and graph breaks, and a block
    torch.compile ran eagerly after all."""
    if not attr:
        return []
    info = json.loads(attr[COMPILED])
    blocks = info["blocks"]
    names = ", ".join((path or ROOT_MODULE) for path in list(blocks)[:4]) + (", ..." if len(blocks) > 4 else "")
    hidden = sum(b["hidden_modules"] for b in blocks.values())
    graphs = sum(b["graphs"] for b in blocks.values())
    breaks = info["graph_breaks"]
    where = f" (first at {breaks[0]['where']}: {breaks[0]['reason']})" if breaks else ""
    lines = [f"compiled: {len(blocks)} block(s) ({names}), {graphs} graph(s) compiled, {len(breaks)} graph "
             f"break(s){where}; the {hidden} module(s) inside them are not recorded (a block shows its inputs, "
             f"outputs and their gradients)"]
    lines += [f"compiled: {path or ROOT_MODULE}: {b['eager']}" for path, b in blocks.items() if b["eager"]]
    return lines + random_lines(info, "")
