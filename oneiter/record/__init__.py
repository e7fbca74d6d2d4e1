"""`record/`: run one training iteration with every module call captured, and (on replay) judge each call locally.

- `run.py`        `record(SpecOptions)`: a model spec recorded end to end (what `oneiter record` runs)
- `session.py`    `RecordingSession`: writer, tensor sink and module hooks of one iteration; `atomic_output`
- `capture.py`    module hooks: every call's inputs, outputs and gradients, in call order (`CallRecord` tree)
- `structure.py`  flattening of nested call arguments into named tensors (the names: `oneiter.format.schema`)
- `reference.py`  load a reference's weights and batch into a model, after a structure check
- `randomness.py` random ops recorded on the reference, replayed on the target
- `options.py`    `RecordOptions`: a recording's settings, checked once (Recorder, `record()`, the integrations)
- `probe.py`, `rerun.py`, `trusted.py`  local error of every call: teacher-forced (or against-cpu) reruns and their
  noise calibration; `rows.py` the rows they build; `optimizer_rows.py` the optimizer's update, stepped in chunks
- `input_grads.py` gradients w.r.t. the model's inputs; `fallback.py` ops run on the CPU (`--fallback`)
- `faults.py`     `--inject-fault`: hooks that break a layer on purpose (tests, demo)
- `layer_replay.py` `oneiter replay`: one recorded layer run again alone (judged by `oneiter.judge.layer`)
"""
