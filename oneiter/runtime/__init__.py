"""`runtime/`: what a training iteration runs on — shared by record, replay, profile and the integrations.

- `modelspec.py`   `--model` specs: built-in names and `file.py:function` builders
- `training.py`    one training iteration (forward, loss, backward, step) and the optimizers
- `devices.py`     device names, vendor plugins imported lazily (torch_npu, torch_mlu, torch_dipu)
- `precision.py`   dtypes, autocast, unit roundoff
- `distributed.py` torchrun ranks, DDP, per-rank file names
- `compiled.py`    torch.compile'd blocks: found, hooked from outside their compiled code, compiled on request
"""
