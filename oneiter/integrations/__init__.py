"""`integrations/`: oneiter inside other training frameworks, with no change to the training code.

- `recording.py`          what every integration shares: its settings (one `RecordOptions`), the steps it records,
                          the Recorder or StepRecorder it opens; the pattern a new framework follows
- `step_driver.py`        one optimizer step (or every K-th) recorded from a framework's own step events: the part
                          the Trainer and Lightning callbacks share (`StepDriver`, `callback_options`)
- `hf.py`                 Hugging Face `transformers`: the Trainer callback `OneIterCallback`
- `hf_profile.py`         Hugging Face `transformers`: `ProfileCallback`, a Trainer's steps profiled
- `lightning.py`          PyTorch Lightning: the callbacks `OneIterCallback` and `ProfileCallback`
- `profile_callback.py`   `ProfileEvents`: what the Trainer's and Lightning's `ProfileCallback` share
- `mmengine.py`           mmengine hooks: `OneIterRecordHook` (a Runner iteration recorded; registered with it, the
                          profiler hook)
- `_mmengine_profiler.py` mmengine's `OneIterProfilerHook`: a Runner's iterations under `oneiter profile`'s profiler
"""
