"""`record/loop/`: what `oneiter.Recorder` (`record/recorder.py`) does in the user's loop, by concern.

- `phases.py`  where the iteration is (`Phase`) and the moves between phases, written down once
- `flow.py`    `IterationFlow`: the iteration's events in order (the model's call, backward, the step), its microbatches
- `entry.py`   what the block sets up as it starts: the reference loaded, the local-error probe, the stats groups
- `attrs.py`   the file's root attributes as the block starts
- `space.py`   whether the output's filesystem can hold the recording (before the block, and once forward is done)
- `given.py`   what the Recorder is given, read: the module, the optimizers inside their wrappers, device and dtypes
"""
