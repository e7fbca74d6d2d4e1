"""`judge/` reads two recordings and judges them: the layer whose own computation is wrong, and where the runs part.

Imports go one way: `measure` -> `iteration` -> `stepwise`, `replayed`.

- `measure/`   how far two tensors are apart and what is tolerated: metrics, statistics entries, tolerances
- `iteration/` one iteration compared: the engine, blame, findings and the verdict; rank by rank; `--suggest`
- `stepwise/`  two multi-step recordings compared step by step: the first step outside the band
- `replayed/`  one replayed layer judged (`oneiter replay`), and its aten ops (`--ops`, `compare --drill`)

How a result is shown (terminal, JSON, CSV, HTML, TensorBoard) is `oneiter.report`; what one file holds
(`oneiter inspect`) is `oneiter.format.inspection`. Nothing here imports typer. torch is imported by `replayed/` (it
runs the layer, through `oneiter.record.replay`) and, in a function, by `iteration/pairing.py` (a replay made in another
dtype: the reference's start cast to it); everything else judges numpy arrays (bfloat16 decoded with numpy; float8
needs torch, in `oneiter.format`).
"""

from oneiter.judge.iteration.engine import compare_files
from oneiter.judge.iteration.entries import Row
from oneiter.judge.iteration.results import CompareResult
from oneiter.judge.measure.metrics import Metrics, compare_arrays
from oneiter.judge.measure.tolerance import DtypeTolerance, Tolerance, default_tolerance

__all__ = [
    "compare_files", "CompareResult", "Row", "Metrics", "compare_arrays", "Tolerance", "DtypeTolerance",
    "default_tolerance",
]
