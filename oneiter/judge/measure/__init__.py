"""`judge/measure/`: how far a target tensor is from its reference, and what is tolerated.

- `metrics.py`        per-entry error metrics (float64, chunked)
- `stat_metrics.py`   two `--level stats` entries judged from their statistics, without tensor data
- `tolerance.py`      which (atol, rtol) an entry is judged with (dtype defaults, overrides; pluggable policy)
- `tolerance_file.py` per-device tolerance files (TOML or mmengine config)
"""
