"""`judge/` reads two recordings and judges them: the layer whose own computation is wrong, and where the runs part.

- `metrics.py`   per-entry error metrics (float64, chunked)
- `tolerance.py` which (atol, rtol) an entry is judged with (dtype defaults, overrides; pluggable policy)
- `tolerance_file.py` per-device tolerance files (TOML or mmengine config)
- `engine.py`    `compare_files` / `compare_local`: pair entries, causal order, rows, first divergence, verdict
- `blame.py`     local (per-layer) error against expected noise: the culprit; the NaN/Inf origin
- `findings.py`  what blame found, and the one table of priorities the verdict picks among them by
- `verdict.py`   the verdict, decided once (status, basis, culprit, first divergence, counts, its sentences):
  every report renders it
- `ranks.py`     torchrun recordings compared rank by rank, in parallel processes

How a result is shown (terminal, JSON, CSV, HTML, TensorBoard) is `oneiter.report`; what one file holds
(`oneiter inspect`) is `oneiter.format.summary`. Nothing here imports typer or torch (bfloat16 is decoded with
numpy; only float8 needs torch).
"""

from oneiter.judge.engine import CompareResult, Row, compare_files
from oneiter.judge.metrics import Metrics, compare_arrays
from oneiter.judge.tolerance import DtypeTolerance, Tolerance, default_tolerance

__all__ = [
    "compare_files", "CompareResult", "Row", "Metrics", "compare_arrays", "Tolerance", "DtypeTolerance",
    "default_tolerance",
]
