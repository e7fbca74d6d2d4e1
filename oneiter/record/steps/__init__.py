"""`record/steps/`: several consecutive iterations of one run in one file.

- `twin.py`          the perturbed twin of a multi-step replay: the band of what the precision explains
- `step_recorder.py` `oneiter.StepRecorder`: `record --steps N`, several iterations of a loop, statistics per step
"""
