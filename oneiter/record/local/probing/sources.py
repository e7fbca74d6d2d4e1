"""Where a probe reads its tensors from, and what it sums over calls.

Where this sits: every probe (`probe.py`) reads the source through a `Cached` (one call's probe reads the same
tensors in its primary rerun, its calibration reruns and its judgement), and adds each rerun's parameter
contributions to its `Sums` (the parameter-gradient rows judge the sums)."""

from __future__ import annotations

from typing import Any

import torch

from oneiter.record.local.rerunning.site import RunResult

__all__ = ["MemorySource", "Cached", "Sums"]

_CPU = torch.device("cpu")


class MemorySource:
    """The source for `--against cpu`: this run's own captured host copies, by path (`TensorSink.keep`)."""

    def __init__(self, store: dict):
        self.store = store

    def has(self, path: str) -> bool:
        return self.store.get(path) is not None

    def tensor(self, path: str):
        return self.store[path]


class Cached:
    """A source that remembers what it read until `clear()`: one call's probe reads the same tensors in its
    primary rerun, its calibration reruns and its judgement."""

    def __init__(self, source):
        self.inner = source
        self._seen: dict[str, Any] = {}

    def has(self, path: str) -> bool:
        return path in self._seen or self.inner.has(path)

    def tensor(self, path: str):
        if path not in self._seen:
            self._seen[path] = self.inner.tensor(path)
        return self._seen[path]

    def clear(self) -> None:
        self._seen.clear()

    def attrs(self, path: str) -> dict:
        """The attributes the source stored with `path` (a shard's placements), {} where it keeps none."""
        attrs = getattr(self.inner, "attrs", None)
        return attrs(path) if callable(attrs) else {}

    def read(self) -> dict:
        """What was read since `clear()`, by path."""
        return dict(self._seen)

    def uncached(self, path: str):
        """A read that is not remembered: the parameter-gradient and optimizer rows read each parameter's
        gradient and state_after once; cached, they would stay in memory for the whole model at once."""
        return self._seen[path] if path in self._seen else self.inner.tensor(path)

    def cached(self, path: str) -> bool:
        """Whether `uncached(path)` hands out the remembered tensor (shared: copy before changing it)."""
        return path in self._seen


class Sums:
    """Per site: the running sum of each parameter's gradient contributions (on the CPU: a single contribution as
    it is, from the second on in float64), and the last value each changed buffer took."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, Any]] = {}

    def add(self, site: str, run: RunResult) -> None:
        mine = self.sums.setdefault(site, {})
        for name, grad in run.grad_contributions.items():
            grad = grad.detach().to(_CPU)  # most parameters have one contributing call: no float64 copy of those
            mine[name] = grad if name not in mine else mine[name].to(torch.float64) + grad
        for name, value in run.changed_buffers.items():
            mine[name] = value.detach().to(_CPU)

    def get(self, site: str, name: str):
        return self.sums.get(site, {}).get(name)

