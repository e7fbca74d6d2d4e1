"""`record/modes/`: what a recording can switch on around the model's own code.

- `dispatch.py`   the base of the modes active while the model's code runs: compiled code, higher-order operators
- `trusted.py`    whether the code running now is oneiter's trusted recomputation, and torch's own kernels for it
- `roundoff_mode.py` a float64 rerun with a lower precision's rounding injected into every op (a noise's bound)
- `randomness.py` random ops recorded on the reference and replayed on the target
- `fallback.py`   `--fallback`: matching torch functions run on the CPU in float32
- `faults.py`     `--inject-fault`: hooks that break a layer on purpose (tests, demo)
- `float8.py`     `--float8`: the model's Linears converted to torchao's float8 training for the recording
- `casts.py`      casts the model's code makes to narrower floats, kept in float64 reruns (their rounding is noise)
- `collectives.py` torch.distributed collectives recorded per rank, and forced in reruns (which never communicate)
- `p2p.py`        point-to-point ops (send, recv) recorded per rank, completed when the caller waits, never twice
- `pipeline.py`   torch.distributed.pipelining's stages: the microbatch of each stage call and of each op it posts
- `active.py`     the modes active while a Recorder's forward and backward run, entered, paused and closed as one
"""
