"""`format/`: the recording on disk (docs/format.md). Imports only `oneiter.errors`; every package above uses it.

- `schema.py`          the HDF5 layout's names: groups, the tensor-name grammar, table columns, raw-bit dtypes
- `layout.py`          the file read: `IterationFile` opens one (validated first) and reads it
- `file_writer.py`     the file written: `FileWriter` creates one recording and writes its datasets and tables
- `validate.py`        what a reader refuses: every link, type and byte count checked before anything is read
- `attributes.py`      the path and the attributes a reader relies on (root, step and call groups), read and checked
- `consistency.py`     what the parts of a recording form (calls, tables, batch), checked as structures
- `mapped.py`          large datasets read by mapping their bytes instead of copying them through HDF5
- `writer.py`          the background writer that turns captured tensors into that layout
- `stats.py`           `--level stats`: per-tensor statistics and checksums (their optional C kernel `_statskernel.c`)
- `numbers.py`         stored arrays as numbers numpy reduces quickly, in float64 chunks
- `inspection.py`      per-tensor statistics of one file (`oneiter inspect`)
- `optimizer_state.py` whether a replay's optimizer started from the reference's state (so its updates are judged)
- `signature.py`       a multi-step recording's per-step signature: loss, gradient and update norms
- `op_case.py`         the runnable reproducer of one aten op (`replay --ops --repro`): imports nothing of oneiter
"""
