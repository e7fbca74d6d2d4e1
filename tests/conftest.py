"""Shared fixtures: small recordings made once per session, and helpers to run the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("ONEITER_NO_PROGRESS", "1")

SMALL_ARGS = {
    "resnet18": {"image_size": 32, "num_classes": 10},
    "mobilenet_v2": {"image_size": 32, "num_classes": 10},
    "llama_tiny": {"seq_len": 16},
}
MODEL_FILES = Path(__file__).parent / "model_files"


@pytest.fixture(scope="session")
def small_args():
    return SMALL_ARGS


def record_small(out: Path, model: str = "resnet18", **kwargs):
    """Record a small model into `out` through the library API; returns the RecordSummary."""
    from oneiter.recorders.record import RecordOptions, record

    kwargs.setdefault("batch_size", 2)
    if model in SMALL_ARGS:
        kwargs.setdefault("model_args", dict(SMALL_ARGS[model]))
    return record(RecordOptions(out=Path(out), model=model, **kwargs))


@pytest.fixture(scope="session")
def resnet_ref(tmp_path_factory) -> Path:
    """A small resnet18 reference recording shared by tests that only read it."""
    out = tmp_path_factory.mktemp("ref") / "ref.h5"
    record_small(out, "resnet18")
    return out
