"""`record/start/`: where an iteration starts.

- `reference.py`       `record --replay`: the target starts from the reference's weights, buffers and batch
- `optimizer_start.py` the optimizer's state when a step begins: what a recording stores, what a replay loads
- `state_names.py`     where an optimizer class keeps Adam's quantities: the reference's state mapped onto the target's
"""
