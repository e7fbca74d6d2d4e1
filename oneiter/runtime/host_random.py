"""The random generators outside torch: Python's `random` and numpy's global one.

Model code draws from them too: Hugging Face's Wav2Vec2, HuBERT and friends pick the time steps SpecAugment masks
in training with `numpy.random` (`_compute_mask_indices`). A recording seeds them with torch's (`seed_all`, what
`transformers.set_seed` does), so a replay draws what its reference drew; and a rerun of a call starts them where
they were when the live call began and leaves them as it found them (`state` / `set_state`), so a rerun draws what
the live call drew and the real iteration never sees a rerun's draws.
"""

from __future__ import annotations

import random
import sys
from typing import Any

__all__ = ["seed_all", "state", "set_state"]


def seed_all(seed: int) -> None:
    """torch's, Python's and numpy's global generators seeded with `seed` (numpy's only when numpy is imported)."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def state() -> tuple[Any, Any]:
    """Python's and numpy's generator states (numpy's None when numpy is not imported)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def set_state(saved: tuple[Any, Any]) -> None:
    """Put both generators back where `state()` found them."""
    random.setstate(saved[0])
    numpy = sys.modules.get("numpy")
    if numpy is not None and saved[1] is not None:
        numpy.random.set_state(saved[1])
