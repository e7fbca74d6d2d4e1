"""`ProfileCallback` on a real Hugging Face `Trainer` and a real Lightning `Trainer`: traces and tables of the
framework's own steps, which `oneiter profile diff` reads (and whose noise verdicts it carries)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

pytest.importorskip("transformers")

from conftest import MODEL_FILES, run_cli  # noqa: E402

from oneiter.profile.summary import read_summary  # noqa: E402
from oneiter.profile.trace import read_trace  # noqa: E402

SCHEDULE = "wait=1,warmup=1,active=2"  # 4 steps profiled, then 5 timed without the profiler


def _check_profile(out_dir, framework: str, layer: str) -> dict:
    """One cycle: its gzipped trace with oneiter's module ranges, its tables, and summary.json's rows."""
    traces = sorted(out_dir.glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and "_cpu_rank0_" in traces[0].name
    assert traces[0].name.endswith("_steps2-3.pt.trace.json.gz")
    assert (out_dir / traces[0].name.replace(".pt.trace.json.gz", ".tables.txt")).is_file()
    summary = read_summary(out_dir)
    assert (summary["framework"], summary["first_step"]) == (framework, 0)
    assert summary["schedule"].startswith(SCHEDULE)
    cycle = summary["cycles"][0]
    assert cycle["steps"] == [2, 3] and cycle["ops"] and cycle["step_us"] > 0
    modules = {row["path"]: row for row in cycle["modules"]}
    assert modules[layer]["fwd_calls"] == 1 and modules[layer]["bwd_calls"] == 1  # once per step
    names = {e.get("name", "") for e in read_trace(traces[0])["traceEvents"]}
    assert f"oneiter.fwd::{layer}" in names and f"oneiter.bwd::{layer}" in names
    assert summary["overhead"]["num_profiled"] == 2 and summary["overhead"]["num_unprofiled"] == 5
    return summary


def _diff(a, b, tmp_path) -> tuple[str, dict]:
    res = run_cli("profile", "diff", a, b, "--json", tmp_path / "diff.json")
    assert res.exit_code == 0, res.output
    return res.stdout, json.loads((tmp_path / "diff.json").read_text())


def test_the_trainer_profile_callback_writes_what_profile_diff_reads(tmp_path):
    from transformers import Trainer, TrainingArguments

    from oneiter.integrations.hf import ProfileCallback

    sys.path.insert(0, str(MODEL_FILES))
    try:
        import hf_llama
    finally:
        sys.path.remove(str(MODEL_FILES))

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 100, (32, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    for name, bf16 in (("fp32", False), ("bf16", True)):
        torch.manual_seed(0)
        model, _, _ = hf_llama.build(2)
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=9, per_device_train_batch_size=2,
                                 bf16=bf16, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                                 logging_strategy="no")
        callback = ProfileCallback(schedule=SCHEDULE)
        Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
        assert callback.out_dir == tmp_path / name / "oneiter_profile"
        summary = _check_profile(callback.out_dir, "transformers", "model.layers.0.mlp.down_proj")
        assert (summary["amp"], summary["optimizer"], summary["batch_size"]) == ("bf16" if bf16 else None, "adamw",
                                                                                  2)
    text, diff = _diff(tmp_path / "fp32" / "oneiter_profile", tmp_path / "bf16" / "oneiter_profile", tmp_path)
    assert diff["module_alignment"] == 1.0 and diff["b"]["amp"] == "bf16"
    assert "A steps: " in text and "B steps: " in text and diff["a"]["noise"] and "steady" in diff["b"]


def test_the_lightning_profile_callback_writes_what_profile_diff_reads(tmp_path):
    pytest.importorskip("lightning", reason="the Lightning callback needs lightning (pip install -e '.[lightning]')")
    sys.path.insert(0, str(MODEL_FILES))
    import lightning_llama

    from oneiter.integrations.lightning import ProfileCallback

    for name, precision in (("fp32", "32-true"), ("bf16", "bf16-mixed")):
        callback = ProfileCallback(schedule=SCHEDULE, out_dir=tmp_path / name)
        lightning_llama.fit([callback], max_steps=9, precision=precision, root=str(tmp_path))
        summary = _check_profile(tmp_path / name, "lightning", "model.model.layers.0.mlp.down_proj")
        assert (summary["amp"], summary["optimizer"], summary["batch_size"]) == (
            "bf16" if name == "bf16" else None, "adamw", 2)
    text, diff = _diff(tmp_path / "fp32", tmp_path / "bf16", tmp_path)
    assert diff["module_alignment"] == 1.0 and diff["ops"]
    assert text.splitlines()[3].startswith("A steps: ")


def test_profile_diff_says_a_ratio_of_unsteady_steps_is_within_noise(tmp_path):
    """Each side's own noise verdict travels into the diff: a side whose steps varied by more than 25% of their
    median marks the step-time ratio as within noise (summary.json edited to say so: the machine's load must not
    decide this test)."""
    from oneiter.profile.diff import diff_profiles, format_diff

    source = MODEL_FILES / "dropout.py"
    res = run_cli("profile", "--model", f"{source}:build", "--schedule", "wait=0,warmup=1,active=2", "-o",
                  tmp_path / "a", "-q")
    assert res.exit_code == 0, res.output
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for name, spread in (("a", 0.01), ("b", 0.6)):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        summary["overhead"].update(profiled_spread=spread, unprofiled_spread=spread, num_profiled=2,
                                   verdict=f"spread {spread:.0%} (edited)")
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    diff = diff_profiles(tmp_path / "a", tmp_path / "b")
    assert (diff.a["steady"], diff.b["steady"]) == (True, False)
    lines = format_diff(diff).splitlines()
    assert "within noise: B not steady" in lines[0]
    assert lines[3:5] == ["A steps: spread 1% (edited)", "B steps: spread 60% (edited)"]


def _profile_hooks() -> list[type]:
    """Every framework's profiling hook: `ProfileEvents` (whose constructor Lightning's callback takes as it is: not
    imported here, lightning alone costs seconds), the Trainer's callback, and mmengine's hook."""
    from oneiter.integrations.hf import ProfileCallback as TrainerCallback
    from oneiter.integrations.profile_callback import ProfileEvents

    mmengine = pytest.importorskip("oneiter.integrations.mmengine")
    return [ProfileEvents, TrainerCallback, mmengine.OneIterProfilerHook]


def test_every_profile_hook_takes_exactly_the_profile_settings():
    """The keywords of each hook are `ProfileSettings`' fields with their defaults (what help() shows), each named
    in its Args; what it is given is what its settings hold; another keyword is refused, naming the hook."""
    import dataclasses
    import inspect

    from oneiter.profile.stepped import ProfileSettings

    fields = [(f.name, f.default) for f in dataclasses.fields(ProfileSettings)]
    for hook in _profile_hooks():
        shown = inspect.signature(hook).parameters.values()
        assert [(p.name, p.default) for p in shown] == fields
        assert {p.kind for p in shown} == {inspect.Parameter.KEYWORD_ONLY}
        args = hook.__doc__.split("Args:")[1]
        assert all(name in args for name, _ in fields), hook
        made = hook(schedule="active=3", out_dir="p", with_stack=True, memory_sort="cpu_memory", model_name="m")
        assert made.settings == ProfileSettings(schedule="active=3", out_dir="p", with_stack=True,
                                                memory_sort="cpu_memory", model_name="m")
        with pytest.raises(TypeError, match=f"{hook.__name__}\\(\\) got an unexpected keyword argument 'tb_trace'"):
            hook(tb_trace=True)
        with pytest.raises(TypeError, match="record_shapes should be a bool, but got 'yes'"):
            hook(record_shapes="yes")
