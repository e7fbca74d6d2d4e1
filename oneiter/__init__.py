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
