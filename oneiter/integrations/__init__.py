"""`integrations/`: oneiter inside other training frameworks, with no change to the training code.

- `step_driver.py`        one optimizer step (or every K-th) recorded from a framework's own step events: the part
                          the Trainer and Lightning callbacks share (`StepDriver`, `callback_options`)
- `hf.py`                 Hugging Face `transformers`: the Trainer callback `OneIterCallback`
- `lightning.py`          PyTorch Lightning: the callback `OneIterCallback`
- `mmengine.py`           mmengine hooks: `OneIterRecordHook` (and, registered with it, the profiler hook)
- `_mmengine_profiler.py` mmengine's `OneIterProfilerHook`: a Runner's iterations under `oneiter profile`'s profiler
"""
