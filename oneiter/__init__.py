"""oneiter: find which layer makes a PyTorch model's training numbers differ between a reference and a target.

The public API (imported lazily, so `import oneiter` and `oneiter --help` do not import torch)::

    import oneiter

    with oneiter.Recorder(model, "ref.h5", optimizer=opt) as rec:          # any training loop
        loss = loss_fn(model(*rec.inputs(x, y)))
        loss.backward(); opt.step()
    with oneiter.Recorder(model, "npu.h5", optimizer=opt, replay="ref.h5", amp="bf16") as rec:
        ...                                                               # the same loop on the target
    with oneiter.StepRecorder(model, "ref.h5", optimizer=opt, steps=12) as rec:   # several iterations, one file
        rec.run(one_step)                                                 # one_step(step): the loop's body
    result = oneiter.compare("ref.h5", "npu.h5")    # .verdict, .culprit, .rows, .to_json(), .exit_code
    oneiter.inspect("ref.h5")                       # what a recording holds

Integrations: `oneiter.integrations.hf.OneIterCallback` (Hugging Face Trainer) and
`oneiter.integrations.mmengine` (mmengine Runner hooks). The CLI (`oneiter record|compare|...`) calls the same API.

The package, layer by layer (imports go one way, down this list: tests/test_import_order.py):

- `errors.py`     typed errors and one-line warnings (`OneIterError`, `warn`)
- `version.py`    the package version, in a leaf module
- `outputs.py`    where every output goes: files written whole or not at all, devices, FIFOs, stdout
- `formatting.py` how a number is written (`sci`), read back from JSON (`num`, `json_ready`), compared (`rel_diff`)
- `models/`       the built-in models (pure torch)
- `runtime/`      what an iteration runs on: model specs, the training step, devices, precision, ranks; commands
- `format/`       the recording on disk: schema, file, validation, statistics
- `record/`       training iterations recorded, and replayed with each call judged locally
- `profile/`      torch.profiler around training iterations
- `judge/`        two recordings judged: one iteration, many steps, one replayed layer
- `report/`       a result shown: terminal, JSON, CSV, HTML, TensorBoard
- `cli/`          the typer app, one module per command
- `integrations/` oneiter inside training frameworks (Hugging Face Trainer, mmengine)
- `api.py`        `oneiter.compare` and `oneiter.inspect`
- `demo.py`       `oneiter demo`: a fault injected, recorded and found
- `__main__.py`   `python -m oneiter`
"""

from oneiter.version import __version__

# public name -> (module, attribute); loaded on first use
_LAZY = {
    "Recorder": ("oneiter.record.recorder", "Recorder"),
    "RecordSummary": ("oneiter.record.recorder", "RecordSummary"),
    "StepRecorder": ("oneiter.record.steps.step_recorder", "StepRecorder"),
    "compare": ("oneiter.api", "compare"),
    "inspect": ("oneiter.api", "inspect"),
    "OneIterError": ("oneiter.errors", "OneIterError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'oneiter' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])
