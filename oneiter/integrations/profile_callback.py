"""`ProfileEvents`: what the Trainer's and Lightning's `ProfileCallback` share (the mmengine hook is the third
user of `profile.stepped`).

A callback subclasses its framework's callback class and this one, calls `_start` when training starts (with what
only the framework knows: its default folder, batch size, seed, autocast, optimizer, how many steps are left) and
forwards each step's begin and end. What is written is what `oneiter profile` writes (`profile/stepped.py`); in a
run with several ranks each rank writes into `<out_dir>/rank<R>/`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from oneiter.profile.stepped import ProfileSettings, StepProfiler
from oneiter.runtime.distributed import current_rank
from oneiter.runtime.wrappers import unwrap_model, unwrap_optimizers

__all__ = ["ProfileEvents"]


class ProfileEvents:
    """Profile the training steps a schedule selects (0 = the first step after training starts) and write what
    `oneiter profile` writes into `out_dir`: one gzipped Chrome trace per cycle
    (`<model>_<device>_rank<R>_steps<a>-<b>.pt.trace.json.gz`), its op, memory and per-module tables
    (`<trace>.tables.txt`), and `summary.json` (with the overhead and its noise verdict), which `oneiter profile
    diff` reads.

    Args: keywords only, the fields of `profile.stepped.ProfileSettings` (declared and checked there):
        schedule: torch.profiler's words, `'wait=1,warmup=1,active=2'` or a dict; one trace per cycle.
        out_dir: the profile folder (default: `oneiter_profile` in the framework's output folder).
        record_shapes / profile_memory / with_stack / with_flops: torch.profiler's options.
        memory_sort: the memory table's sort column (`profile.tables.MEMORY_SORTS`).
        module_ranges: forward/backward ranges per module path (the module table needs them).
        model_name: the name in file names and summary.json (default: the model's class name).
        force: replace a previous oneiter profile in `out_dir`.
    """

    FRAMEWORK = ""

    def __init__(self, **settings: Any):
        self.settings = ProfileSettings.given(type(self).__name__, settings)  # its fields: the keywords
        self.profiler: Optional[StepProfiler] = None

    __init__.__signature__ = ProfileSettings.keywords_signature()  # type: ignore[attr-defined]  # for help()

    @property
    def summary(self) -> Optional[dict[str, Any]]:
        """summary.json's content once profiling started."""
        return self.profiler.summary if self.profiler is not None else None

    @property
    def out_dir(self) -> Optional[Path]:
        return self.profiler.out_dir if self.profiler is not None else self.settings.profile_dir

    def _start(self, model, optimizer, *, default_dir: Union[str, os.PathLike], batch_size: int, seed: int,
               amp: Optional[str], remaining: Optional[int], first_step: int, version: str) -> None:
        """Training starts: check the schedule fits, and turn the profiler on."""
        self.settings.check_fits(remaining, "steps")
        model = unwrap_model(model)
        out_dir = self.settings.profile_dir or Path(default_dir) / "oneiter_profile"
        info = current_rank()
        if info.distributed:  # each rank its own folder: one summary.json each
            out_dir = out_dir / f"rank{info.rank}"
        optimizers = unwrap_optimizers(optimizer) if optimizer is not None else []
        options = self.settings.options(model, out_dir=out_dir, batch_size=batch_size, seed=seed, amp=amp,
                                        optimizer=",".join(type(o).__name__.lower() for o in optimizers))
        self.profiler = StepProfiler(model, options, self.settings.profile_schedule,
                                     extra={"first_step": first_step, "framework": self.FRAMEWORK,
                                            f"{self.FRAMEWORK}_version": version})
        self.profiler.start()

    def _begin_step(self) -> None:
        if self.profiler is not None:
            self.profiler.begin_step()

    def _end_step(self) -> None:
        if self.profiler is not None:
            self.profiler.end_step()

    def _end_run(self) -> None:
        if self.profiler is not None:
            self.profiler.end_run()

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
