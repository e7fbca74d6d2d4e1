"""`record/local/`: each module call's own error, measured while a replay records.

- `reduced.py`        a run's reduced-precision float32 matmuls and convolutions (TF32, HF32) reproduced in a rerun
- `rerun.py`          one recorded call rerun with its children forced, at a chosen place and precision
- `rerunning/`        the rerun's parts: its site and result, isolation, forced children, seeds, layouts, metrics
- `rerun_queues.py`   which of the source's collectives a call's rerun runs (hidden calls of a compiled block too)
- `fidelity.py`       a rerun counts only where it reproduces the live call
- `montecarlo.py`     a precision's noise by Monte Carlo, where the float64 calibration cannot run
- `rows.py`           `JudgedRow`: one row of the `/local` table
- `optimizer_rows.py` the optimizer's update, each parameter judged on its own (a shadow step, in chunks)
- `clipping.py`       the gradients as the step sees them (clipping, unscaling): stored, and the clipping judged
- `carried.py`        state carried between two calls of one iteration through a module attribute
- `formats.py`        number formats as oneiter rounds to them itself (float8, bfloat16, ...), in float64
- `recipes.py`        the recipe table: low-precision training recipes (torchao float8, MX) read from a module
- `emulate.py`        a recipe's exact emulation: scales, casts, exact products; what a correct kernel may differ by
- `recipe_rows.py`    the rows of calls that run a recipe: judged against its emulation, the format's cost beside
- `probe.py`          the probes: teacher-forced (or against-CPU) reruns of every call and their noise calibration
- `probing/`          `LocalProbe`, what both probes share: state, noise bound, calibration, summed values, calls
"""
