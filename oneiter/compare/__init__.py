"""`compare/` reads recordings and judges them: the layer whose own computation is wrong, and where the runs part.

- `metrics.py`   per-entry error metrics (float64, chunked)
- `tolerance.py` which (atol, rtol) an entry is judged with (dtype defaults, overrides; pluggable policy)
- `engine.py`    `compare_files` / `compare_local`: pair entries, causal order, rows, first divergence, verdict
- `blame.py`     local (per-layer) error against expected noise: the culprit; the NaN/Inf origin
- `tolerance_file.py` per-device tolerance files (TOML or mmengine config)
- `report.py`    terminal report, JSON, CSV
- `html_report.py`, `tb_report.py` the self-contained HTML page and TensorBoard curves/histograms
- `ranks.py`     torchrun recordings compared rank by rank, in parallel processes
- `summary.py`   per-tensor statistics of one file (`oneiter inspect`)

Nothing here imports typer or torch (bfloat16 is decoded with numpy; only float8 needs torch).
"""

from .engine import CompareResult, Row, compare_files
from .metrics import Metrics, compare_arrays
from .tolerance import DtypeTolerance, Tolerance, default_tolerance

__all__ = [
    "compare_files", "CompareResult", "Row", "Metrics", "compare_arrays", "Tolerance", "DtypeTolerance",
    "default_tolerance",
]
