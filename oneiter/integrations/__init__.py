"""`integrations/`: oneiter inside other training frameworks (mmengine hooks; Hugging Face Trainer callback).

- `recording.py`          what every integration shares: its settings (a `RecordOptions`), the steps it records, the
                          Recorder it opens; the pattern a new framework follows
- `hf.py`                 `OneIterCallback`: a Hugging Face `Trainer` step recorded
- `mmengine.py`           `OneIterRecordHook` (a Runner iteration recorded) and the profiler hook's registration
- `_mmengine_profiler.py` `OneIterProfilerHook`: a Runner's iterations profiled as `oneiter profile` does
"""
