"""`judge/iteration/`: two recordings of one iteration compared.

- `engine.py`   `compare_files` / `compare_local`: pair entries, causal order, rows, first divergence, verdict
- `blame.py`    local (per-call) error against expected noise: the culprit; the NaN/Inf origin
- `findings.py` what blame found, and the one table of priorities the verdict picks among them by
- `verdict.py`  the verdict, decided once (status, basis, culprit, first divergence, counts, its sentences)
- `ranks.py`    torchrun recordings compared rank by rank, in parallel processes (or a torchrun job's)
- `collectives.py` every rank's collectives against the exact reduction of its group's recorded inputs
- `suggest.py`  `compare --suggest`: from a `--level stats` screening to the region to record in full
"""
