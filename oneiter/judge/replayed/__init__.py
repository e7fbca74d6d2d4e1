"""`judge/replayed/`: one recorded layer run again (`oneiter replay`), judged.

- `layer_verdict.py` each tensor the layer produced again against its recording
- `op_verdict.py`    `--ops`: which aten op inside the culprit, or whether the program itself differs
"""
