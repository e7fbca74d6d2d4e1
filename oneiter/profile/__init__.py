"""`oneiter profile`: torch.profiler around training iterations, leaving what a performance engineer opens next.

One file per job, in pipeline order (nothing here imports torch until a function runs):

- `schedule.py`: parse `wait=1,warmup=1,active=2`, count the steps it needs, refuse unreachable windows;
- `runner.py`: `profile(ProfileOptions) -> ProfileResult`, the run `oneiter profile` drives;
- `profile_session.py`: `ProfileSession`, one profiling run driven step by step (by the runner and the framework
adapters);
- `stepped.py`: `StepProfiler`, a training framework's own steps profiled from its step events (mmengine, Trainer,
  Lightning);
- `run_parts.py`: what both share: the summary head, profiler activities, device sync and the one trace handler;
- `module_ranges.py`: forward/backward ranges per module path, placed by oneiter's own hooks;
- `trace.py`: the readable, fast-gzipped Chrome trace of one cycle;
- `tables.py`: op, memory and per-module tables (rows and fixed-width text);
- `summary.py`: `summary.json` and the output-directory guard;
- `diff.py`: `diff_profiles(A, B)`, two profiles aligned by module path and op name;
- `quiet.py`: Kineto's native log lines kept out of the terminal.
"""
