"""Shared fixtures: small recordings made once per session, and helpers to run the CLI."""

from __future__ import annotations

import os
import platform
import re
import shutil
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("ONEITER_NO_PROGRESS", "1")
# torch's OpenMP threads sleep when they wait instead of spinning (GNU OpenMP's default: spin ~0.3 s first). Set
# before torch loads (its libgomp reads it then); the CLI processes and torchrun ranks the tests start inherit it.
# The numbers are the same (same threads, same split of the work); on a loaded machine a spinning thread holds a
# core another test's thread waits for: one tiny conv net's 30 iterations took 79 s instead of 1.3-5.5 s with 16
# processes running on 2 cores (bench/suite_time.py measures the suite).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
    from oneiter.record.run import SpecOptions, record

    kwargs.setdefault("batch_size", 2)
    if model in SMALL_ARGS:
        kwargs.setdefault("model_args", dict(SMALL_ARGS[model]))
    return record(SpecOptions(out=Path(out), model=model, **kwargs))


@pytest.fixture(scope="session")
def resnet_ref(references) -> Path:
    """A small resnet18 reference recording shared by tests that only read it (the one `references` holds)."""
    return references("resnet18")


FAULT_LAYER = {"resnet18": "layer3.1.conv2", "mobilenet_v2": "features.12.conv.1.0",
               "llama_tiny": "layers.1.feed_forward.w2"}
BUILTIN = ("resnet18", "mobilenet_v2", "llama_tiny")


@pytest.fixture(scope="session")
def mlp_pair(tmp_path_factory):
    """The MLP recordings of `tests/format/mutants.py` (`make_pair`: a reference, a replay target, a plain and a
    statistics-level recording, a 3-step reference), made once per session: every test that uses them only reads
    them (the format tests change copies)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "format"))
    import mutants

    return mutants.make_pair(tmp_path_factory.mktemp("mlp_pair"))


@pytest.fixture(scope="session")
def files(mlp_pair, tmp_path_factory):
    """Of `mlp_pair`: the reference, a plain recording equal to it, and a copy of that with one output changed
    (shared by the exit-code and output tests)."""
    import h5py

    pair = mlp_pair
    diverged = tmp_path_factory.mktemp("mlp_files") / "diverged.h5"
    diverged.write_bytes(pair.plain.read_bytes())
    with h5py.File(diverged, "r+") as f:
        f["calls/0@0/forward/output"][0, 0] += 1.0
    return pair.ref, pair.plain, diverged


PYTHON_WARNING = re.compile(r"\.py:\d+: \w*Warning|UserWarning")  # how Python's default display shows one


def run_cli(*args):
    """Run the real `oneiter` app in-process; returns typer's Result (exit_code, stdout, stderr, output). Every CLI
    test also checks that no warning reached stderr in Python's own form (file:line, category, source line): the
    CLI shows each as one `warning:` line."""
    from typer.testing import CliRunner

    from oneiter.cli.main import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert not PYTHON_WARNING.search(res.stderr), res.stderr
    return res


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """One small float32 CPU reference per built-in model or model file (a `file.py:build` spec) and recording
    settings (`record_small`'s keywords, e.g. `batch_size=8`), recorded clean on first use and shared by every test
    that asks for the same: tests only read it (a test that changes a reference changes a copy)."""
    made = {}

    def get(model: str, **kwargs) -> Path:
        key = (model, repr(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("ref") / "ref.h5"
            record_small(out, model, **kwargs)
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def replays(references, tmp_path_factory):
    """One replay of `references(model)` per set of `replay` keywords (`amp="bf16"`, `faults=[...]`), made on first
    use and shared by every test that asks for the same (tests only read it, as `references`)."""
    made = {}

    def get(model: str, **kwargs) -> Path:
        key = (model, repr(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("replay") / "tgt.h5"
            replay(references(model), out, **kwargs)
            made[key] = out
        return made[key]

    return get


def compare_verdict(ref: Path, tgt: Path, tmp_path: Path) -> tuple[int, dict]:
    """`oneiter compare ref tgt --json`: its exit code (0 or 1, asserted) and the JSON report's verdict."""
    import json

    report = tmp_path / "report.json"
    res = run_cli("compare", ref, tgt, "--json", report)
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(report.read_text())["verdict"]


def replay(ref: Path, out: Path, **kwargs):
    """Record a target replaying `ref` through the library API. A reference made from a model file is replayed
    with that file named explicitly, as a user must (a recording never chooses which code runs)."""
    from oneiter.format.layout import IterationFile
    from oneiter.record.run import SpecOptions, record
    from oneiter.runtime.modelspec import is_file_spec

    if "model" not in kwargs:
        with IterationFile(ref) as f:
            spec = f.meta.get("model")
        if isinstance(spec, str) and is_file_spec(spec):
            kwargs["model"] = spec
    return record(SpecOptions(out=Path(out), replay=Path(ref), **kwargs))


FAULT_ENV = "ONEITER_TEST_FAULT"


@pytest.fixture(autouse=True)
def _no_leftover_fault(monkeypatch):
    """Model files under model_files/ patch torch functions and classes when ONEITER_TEST_FAULT is set: start
    every test without the variable, and undo whatever a model file patched once it is over."""
    import sys

    monkeypatch.delenv(FAULT_ENV, raising=False)
    yield
    kit = sys.modules.get("faultkit")
    if kit is not None:
        kit.undo_faults()


@pytest.fixture
def plugin():
    """The stand-in vendor plugin (`model_files/faulty_kernels.py`), importable as a plugin is; its kernels removed
    after the test."""
    import sys

    sys.path.insert(0, str(MODEL_FILES))
    import faulty_kernels

    yield faulty_kernels
    faulty_kernels.uninstall()
    sys.path.remove(str(MODEL_FILES))


def replay_with_fault(ref: Path, out: Path, fault: str, monkeypatch, **kwargs):
    """Replay `ref` with the model file's own fault `fault` (ONEITER_TEST_FAULT, read by its builder)."""
    monkeypatch.setenv(FAULT_ENV, fault)
    try:
        return replay(ref, out, **kwargs)
    finally:
        monkeypatch.delenv(FAULT_ENV, raising=False)
        import sys

        sys.modules["faultkit"].undo_faults()


def _why_no_kernel() -> str | None:
    """Why this machine cannot have the optional C kernel, or None where the install must have built it (a C
    compiler and Python's headers; its vectorized path also needs an x86-64 CPU with AVX2 and FMA)."""
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        return "no C compiler: the install skips the optional kernel"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers: the install skips the optional kernel"
    return None


def why_no_stats_kernel() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel's vectorized path is x86-64 only (this is {platform.machine()})"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if flags and not ({"avx2", "fma"} <= set(flags.split())):
        return "this CPU has no AVX2/FMA: the kernel is built but torch's reductions run instead"
    return _why_no_kernel()


NEEDS_STATS_KERNEL = pytest.mark.skipif(why_no_stats_kernel() is not None, reason=str(why_no_stats_kernel()))
"""For tests of the optional C kernel itself: skipped, with the reason, only where the install cannot build it."""


def load_tool(name: str, folder: str = "tools"):
    """A script of tools/ (or bench/) as a module (neither is a package: their scripts run as
    `python tools/check_refs.py`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_reads_back(path: Path, layer: str, model: str, *, refused: bool = False) -> None:
    """What a writer wrote reads back: `oneiter inspect` and `oneiter compare FILE FILE` take it (a match), and
    `oneiter replay FILE --layer LAYER -m MODEL` replays that layer from it (exit 0) or, `refused`, refuses the file in
    one line (exit 2: a file no layer can be replayed from, said as such)."""
    import json

    res = run_cli("inspect", path)
    assert res.exit_code == 0, res.output
    res = run_cli("compare", path, path, "--json", "-")
    assert res.exit_code == 0 and json.loads(res.stdout)["verdict"]["status"] == "match", res.output
    res = run_cli("replay", path, "--layer", layer, "-m", model)
    if refused:
        assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    else:
        assert res.exit_code == 0, res.output
