"""Which of the source's collectives a rerun of one call runs, and so must be handed (`collectives.CollectiveForcer`).

Where this sits: `rerun.Rerunner` forces, in a call's rerun, the collectives the call's own code ran — its own, and
those of the descendants that run live in the rerun (the calls not probed: a probed child is forced, its recorded
output returned instead of running). A call this run never saw runs live too: a compiled block hides the modules
inside it (`runtime/compiled.py`), so an eager reference recorded a tensor-parallel all-reduce at `blocks.0.down@0`
that the compiled target's `blocks.0@0` runs as its own code. Such a collective belongs to the nearest call around it
(`RecordedCollective.ancestors`, the source's call tree) that this run knows.
"""

from __future__ import annotations

from oneiter.format.schema import BACKWARD, FORWARD

__all__ = ["rerun_queues"]


def rerun_queues(rec, collectives: list, probed: str) -> dict[str, list]:
    """Phase -> the collectives (in order) the rerun of `rec` (a CallRecord) runs; `probed` is the status of a call
    whose rerun stands for it (it is forced in its parent's)."""
    known, live, stack = {rec.key}, {rec.key}, [(child, True) for child in rec.children]
    while stack:
        child, runs = stack.pop()
        known.add(child.key)
        runs = runs and child.status != probed
        if runs:
            live.add(child.key)
        stack.extend((grandchild, runs) for grandchild in child.children)
    queues: dict[str, list] = {FORWARD: [], BACKWARD: []}
    for item in collectives:
        owner = item.call if item.call in known else next((a for a in item.ancestors if a in known), None)
        if owner in live and not item.recomputed:
            queues.setdefault(item.phase, []).append(item)
    return queues
