"""Progress off a terminal: a plain line as each phase starts, then at most one every few seconds; `--quiet`
silences it (`oneiter/cli/progress.py`)."""

from __future__ import annotations

from conftest import run_cli

from oneiter.cli.progress import PlainProgress

TINY = ("-m", "llama_tiny", "--model-arg", "seq_len=8", "--model-arg", "dim=32", "-b", "1")


def test_plain_progress_prints_each_phase_then_at_most_one_line_every_few_seconds():
    now, lines = [0.0], []
    progress = PlainProgress("recording m", lines.append, every=5.0, clock=lambda: now[0])
    for t, phase, count in [(0.1, "forward", 1), (1, "forward", 50), (4.9, "forward", 90), (5.2, "forward", 120),
                            (6, "forward", 130), (10.3, "forward", 200), (10.4, "backward", 201),
                            (11, "backward", 300), (12, "step", 300)]:
        now[0] = t
        progress(phase, f"{count} tensors captured")
    assert lines == ["recording m: forward, 1 tensors captured (0 s)",
                     "recording m: forward, 120 tensors captured (5 s)",
                     "recording m: forward, 200 tensors captured (10 s)",
                     "recording m: backward, 201 tensors captured (10 s)",
                     "recording m: step, 300 tensors captured (12 s)"]


def test_record_off_a_terminal_prints_plain_phase_lines_and_quiet_silences_them(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEITER_NO_PROGRESS", raising=False)  # conftest silences progress for every other test
    res = run_cli("record", *TINY, "-o", tmp_path / "ref.h5")
    assert res.exit_code == 0, res.output
    phases = [line.split(": ")[1].split(",")[0] for line in res.stderr.splitlines()
              if line.startswith("recording llama_tiny: ")]
    assert phases == ["forward", "backward", "parameters", "step", "writing"]
    assert "\r" not in res.stderr and "\x1b[" not in res.stderr  # plain lines: no spinner, no cursor control
    res = run_cli("record", *TINY, "-o", tmp_path / "q.h5", "--quiet")
    assert res.exit_code == 0 and "recording llama_tiny:" not in res.stderr
    assert res.stderr.splitlines()[-1].startswith("recorded ")  # the summary line stays
