"""`runtime/`: what a training iteration runs on — shared by record, replay, profile and the integrations.

- `modelspec.py`   `--model` specs: built-in names and `file.py:function` builders
- `training.py`    one training iteration (forward, loss, backward, step) and the optimizers
- `devices.py`     the device table: device names, vendor plugins imported lazily, what differs per device type
- `precision.py`   dtypes, autocast, unit roundoff
- `precision_modes.py` reduced-precision float32 modes (TF32, HF32): what torch's flags say, and their rounding
- `roundoff.py`    the rounding a precision adds to one op, for injecting into a float64 run (Monte Carlo arithmetic)
- `kernels.py`     which kernels a device runs that are not torch's own, asked of the dispatcher
- `names.py`       the names a model's parameters and buffers have in a recording (never state_dict's)
- `host_random.py` the random generators outside torch (Python's, numpy's): seeded, and kept around reruns
- `module_state.py` the tensors a module keeps in plain attributes between calls: as a call found them, for its rerun
- `distributed.py` torchrun ranks, DDP, per-rank file names, the process group compare shares its work over
- `sharding.py`    DTensor parameters (FSDP2, tensor parallelism), whether a model parallelises itself, how
                   gradients are reduced
- `meshes.py`      which dimensions of a model's device mesh DDP wraps (`record --data-parallel`, per dimension)
- `commands.py`    the CLI's flag names, and the command lines oneiter prints for a user to run
- `wrappers.py`    what frameworks wrap around a model and an optimizer (DDP, accelerate, Lightning), and what is inside
- `compiled.py`    torch.compile'd blocks: found, hooked from outside their compiled code, compiled on request
"""
