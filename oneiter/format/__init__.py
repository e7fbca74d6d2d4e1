"""`format/`: the recording on disk (docs/format.md).

- `layout.py`  the one module that knows the HDF5 layout and the tensor-name grammar (`IterationFile`, paths, keys)
- `writer.py`  the background writer that turns captured tensors into that layout
- `summary.py` per-tensor statistics of one file (`oneiter inspect`)
"""
