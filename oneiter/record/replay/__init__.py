"""`record/replay/`: one recorded layer run again, alone (`oneiter replay`).

- `layer_replay.py` the layer from its recorded inputs and weights, on any device and precision
- `op_rerun.py`     every aten op of that call rerun alone on its own inputs (`replay --ops`)
- `graph_ops.py`    `--ops` of a compiled layer: every node of its compiled graphs, judged on its own inputs
- `op_repro.py`     `--repro DIR`: the culprit op as a case a vendor runs without oneiter
"""
