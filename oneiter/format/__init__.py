"""`format/`: the recording on disk (docs/format.md). Imports only `oneiter.errors`; every package above uses it.

- `schema.py`   the HDF5 layout's names: groups, the tensor-name grammar, table columns, raw-bit dtypes
- `layout.py`   the file: `FileWriter` writes one, `IterationFile` (validated by `validate.py`) reads one
- `writer.py`   the background writer that turns captured tensors into that layout
- `stats.py`    `--level stats`: per-tensor statistics and checksums (compared in `oneiter.judge.measure.stat_metrics`)
- `summary.py`  per-tensor statistics of one file (`oneiter inspect`), with `numbers.py`'s reductions
"""
