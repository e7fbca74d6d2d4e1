"""`runtime/`: what a training iteration runs on — shared by record, replay, profile and the integrations.

- `modelspec.py`   `--model` specs: built-in names and `file.py:function` builders
- `training.py`    one training iteration (forward, loss, backward, step) and the optimizers
- `devices.py`     device names, vendor plugins imported lazily (torch_npu, torch_mlu, torch_dipu)
- `precision.py`   dtypes, autocast, unit roundoff
- `precision_modes.py` reduced-precision float32 modes (TF32, HF32): the flags, and rounding to them
- `roundoff.py`    the rounding a precision adds to one op, for injecting into a float64 run (Monte Carlo arithmetic)
- `kernels.py`     which kernels a device runs that are not torch's own, asked of the dispatcher
- `distributed.py` torchrun ranks, DDP, per-rank file names
"""
