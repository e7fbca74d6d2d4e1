"""The product card's commands (the first code block of README.md) run verbatim, as a user pastes them.

The commands are read out of the README, so the test follows the card. Each runs as `python -m oneiter ...` in
its own process, in a temporary folder (the profile writes `prof/` into the current directory). On a machine
without CUDA or an NPU the record and compare lines end in their one-line errors, exit 2.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
SMALL = ["--batch-size", "2", "--model-arg", "image_size=32", "--no-overhead"]


def card() -> list[list[str]]:
    """The `oneiter ...` lines of README's first code block, split as a shell would (comments dropped)."""
    block = re.search(r"^```\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("oneiter ")]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert args[0] == "oneiter"
    return subprocess.run([sys.executable, "-m", "oneiter", *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_the_card_is_record_replay_compare_profile():
    commands = card()
    assert [c[:2] for c in commands] == [["oneiter", "record"], ["oneiter", "record"], ["oneiter", "compare"],
                                         ["oneiter", "profile"]]  # fmt: skip
    assert "--replay" in commands[1] and "--model" in commands[3]


def test_the_cards_record_and_compare_lines_verbatim(tmp_path):
    record_ref, record_npu, compare, _ = card()
    res = run(record_ref, tmp_path)
    if torch.cuda.is_available():
        assert res.returncode == 0, res.stderr
    else:
        assert one_line_error(res) == ("error: device 'cuda' is not available on this machine "
                                       "(torch.cuda.is_available() is false)")  # fmt: skip
    res = run(record_npu, tmp_path)
    if importlib.util.find_spec("torch_npu") is None:
        assert "install torch-npu" in one_line_error(res)
    elif not (tmp_path / "ref.h5").exists():
        assert one_line_error(res)  # an NPU machine without CUDA: no reference to replay
    res = run(compare, tmp_path)
    if not (tmp_path / "ref.h5").exists():
        assert one_line_error(res) == "error: 'ref.h5' does not exist"
    elif not (tmp_path / "npu.h5").exists():
        assert one_line_error(res) == "error: 'npu.h5' does not exist"


def check_profile(res: subprocess.CompletedProcess, cwd: Path) -> None:
    assert res.returncode == 0, res.stderr
    summary = json.loads((cwd / "prof" / "summary.json").read_text())
    assert summary["model"] == "resnet18" and len(summary["cycles"]) == 1
    assert all((cwd / "prof" / name).is_file() for name in summary["files"])
    assert res.stdout.startswith("profiled resnet18 on ")


@pytest.mark.slow
def test_the_cards_profile_line_verbatim(tmp_path):
    res = run(card()[3], tmp_path)
    check_profile(res, tmp_path)
    assert sorted(p.suffix for p in (tmp_path / "prof").iterdir()) == [".gz", ".json", ".txt"]


def without_model(args: list[str]) -> list[str]:
    i = args.index("--model")
    return args[:i] + args[i + 2:]


def test_profile_without_model_says_so_first_small(tmp_path):
    """The card's profile line without `--model` profiles the built-in resnet18 and says so first (small shapes:
    the card's own line, at full size, is profiled verbatim above)."""
    args = without_model(card()[3])
    assert args == ["oneiter", "profile", "--schedule", "wait=1,warmup=1,active=2"]
    res = subprocess.run([sys.executable, "-m", "oneiter", *args[1:], *SMALL], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout
    assert res.stdout.splitlines()[0] == ("no --model: profiling the built-in resnet18 "
                                          "(--model NAME or path/to/file.py:function for another)")  # fmt: skip
    assert json.loads((tmp_path / "prof" / "summary.json").read_text())["model"] == "resnet18"
