"""`record/`: run training iterations with every module call captured, and (on replay) judge each call locally.

Imports go one way, in this order: `capture` -> `modes` -> `options` -> `start` -> `local` -> `session` ->
`recorder` -> `steps` -> `run`; `replay`, `impact` and `loop` sit above `local`.

- `capture/`     module hooks and what they name: calls, arguments, gradients, the batch, recomputations, errors
- `modes/`       what a recording can switch on: replayed randomness, CPU fallback, injected faults, trusted code
- `start/`       where a replay starts: the reference's weights, buffers, batch and optimizer state
- `local/`       each call's own error: teacher-forced reruns, their fidelity check, noise calibration, optimizer rows
- `steps/`       several iterations in one file: the step recorder and the perturbed twin
- `replay/`      one recorded layer run again alone (`oneiter replay`), its aten ops, the op reproducer
- `impact/`      which flagged call matters: the iteration run again with each one fixed (`record --impact`)
- `loop/`        the Recorder's block by concern: its phases and events, what it sets up, the file's attributes
- `options.py`   `RecordOptions`: a recording's settings, checked once (Recorder, `record()`, the integrations)
- `session.py`   `RecordingSession`: writer, tensor sink and module hooks of one iteration; `atomic_output`
- `recorder.py`  `oneiter.Recorder`: one iteration of a live model in the user's own loop
- `run.py`       `record(SpecOptions)`: a model spec recorded end to end (what `oneiter record` runs)
"""
