"""profile: schedule-exact traces, op/memory/module tables, overhead, Kineto kept quiet, profile diff (CPU)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from oneiter.cli import profile_cmd
from oneiter.errors import OneIterError
from oneiter.profile.diff import _ratio, diff_profiles, format_diff
from oneiter.profile.module_ranges import ModuleRanges
from oneiter.profile.runner import ProfileOptions, profile
from oneiter.profile.schedule import ScheduleError, parse_schedule
from oneiter.profile.summary import prepare_out_dir, read_summary
from oneiter.profile.trace import trace_stem

SMALL = {"image_size": 32, "num_classes": 10}
RESNET18_LEAVES = 52  # conv, bn, relu per block, downsample convs/bns, stem, pool, fc
CPU_NOTE = "has no CUDA"


def small_options(out: Path, **kwargs) -> ProfileOptions:
    kwargs.setdefault("model", "resnet18")
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("model_args", dict(SMALL))
    return ProfileOptions(out_dir=out, **kwargs)


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:  # raises if it is not gzip or not JSON
        return json.load(fh)["traceEvents"]


def step_numbers(events: list[dict]) -> list[int]:
    return sorted(int(m.group(1)) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))))


@pytest.fixture(scope="module")
def fp32_cli(tmp_path_factory):
    """The README command on a small resnet18, through the CLI, with --profile-memory."""
    out = tmp_path_factory.mktemp("prof_fp32")
    args = ["--model", "resnet18", "--device", "cpu", "--schedule", "wait=1,warmup=1,active=2", "-o", str(out),
            "--batch-size", "2", "--model-arg", "image_size=32", "--model-arg", "num_classes=10",
            "--profile-memory"]
    result = CliRunner().invoke(profile_cmd.app, args)
    return out, result


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof_bf16")
    profile(small_options(out, dtype="bfloat16", profile_memory=True, measure_overhead=False))
    return out


# schedule ---------------------------------------------------------------------------------------------------
def test_schedule_counts_exactly_the_steps_it_needs():
    sched = parse_schedule("wait=1,warmup=1,active=2")
    assert (sched.num_steps, sched.active_steps(0)) == (4, [2, 3])
    assert [sched.phase(i) for i in range(5)] == ["wait", "warmup", "active", "active", "done"]
    sched = parse_schedule("skip_first=3, wait=1, warmup=1, active=2, repeat=2")
    assert sched.num_steps == 3 + 2 * 4
    assert sched.active_steps(0) == [5, 6] and sched.active_steps(1) == [9, 10]
    assert parse_schedule("active=3").active_steps(0) == [1, 2, 3]  # warmup defaults to 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("wait=5,active=0", "never reached"),
        ("active=2,repeat=0", "repeat >= 1"),
        ("wait=1,active=two", "must be an integer"),
        ("wait=1,activ=2", "KEY=VALUE"),
        ("wait=-1,active=1", ">= 0"),
        ("active=1,active=2", "twice"),
    ],
)
def test_bad_schedules_are_refused(text, message):
    with pytest.raises(ScheduleError, match=message):
        parse_schedule(text)


def test_schedule_beyond_max_steps_is_refused():
    with pytest.raises(ScheduleError, match="never reached"):
        parse_schedule("skip_first=500,active=1").check_budget(100)


@pytest.mark.parametrize(
    "schedule, extra",
    [("wait=5,active=0", []), ("skip_first=500,active=2", []), ("wait=3,active=1", ["--max-steps", "4"])],
)
def test_cli_unreachable_schedule_exits_2_with_a_message(tmp_path, schedule, extra):
    args = ["--model", "resnet18", "--schedule", schedule, "-o", str(tmp_path / "p"), *extra]
    result = CliRunner().invoke(profile_cmd.app, args)
    assert result.exit_code == 2, result.output
    assert "never reached" in result.stderr and "Traceback" not in result.output + result.stderr
    assert not (tmp_path / "p").exists()  # refused before anything was written


# one profile through the CLI ---------------------------------------------------------------------------------
def test_one_trace_covering_exactly_the_active_steps(fp32_cli):
    out, result = fp32_cli
    assert result.exit_code == 0, result.output + result.stderr
    traces = sorted(out.glob("*.pt.trace.json.gz"))
    assert [t.name for t in traces] == ["resnet18_cpu_rank0_steps2-3.pt.trace.json.gz"]
    events = trace_events(traces[0])
    assert step_numbers(events) == [2, 3]
    assert not list(out.glob(".*tmp*"))  # the temporary export is gone
    names = {e.get("name", "") for e in events}
    assert "oneiter.fwd::layer3.0.conv1" in names and "oneiter.bwd::layer3.0.conv1" in names
    assert not any(n.startswith("oneiter.bwd.begin::") for n in names)  # markers became spans


def test_cli_prints_tables_overhead_and_the_cpu_note_once(fp32_cli):
    out, result = fp32_cli
    assert result.stderr.count(CPU_NOTE) == 1 and "Traceback" not in result.stderr
    assert "USDT" not in result.output + result.stderr
    for heading in ("== ops", "== memory", "== leaf modules", "overhead:"):
        assert heading in result.stdout
    summary = read_summary(out)
    o = summary["overhead"]
    assert (o["num_profiled"], o["num_unprofiled"]) == (2, 5) and o["unprofiled_median_s"] > 0
    assert f"overhead: {o['verdict']}" in result.stdout
    assert o["ratio"] is None if o["unprofiled_spread"] > 0.25 else o["ratio"] > 0
    assert summary["cycles"][0]["profiler_steps"] == [2, 3]


def test_overhead_is_a_ratio_of_medians_or_says_the_machine_is_too_noisy():
    from oneiter.profile.profile_session import overhead

    quiet = overhead([0.12, 0.11, 0.13], [0.10, 0.10, 0.11, 0.10, 0.09])
    assert quiet["ratio"] == pytest.approx(0.12 / 0.10) and quiet["verdict"].startswith("1.20x (median 120.0 ms")
    assert quiet["unprofiled_spread"] == pytest.approx(0.2)
    noisy = overhead([0.12, 0.11], [0.10, 0.30, 0.05, 0.10, 0.11])  # the plain steps alone vary by 250 %
    assert noisy["ratio"] is None and noisy["verdict"].startswith("machine too noisy to tell: unprofiled steps vary")
    few = overhead([0.0005], [0.0073, 0.0070, 0.0071])  # one profiled step is no figure (the 0.07x of old)
    assert few["ratio"] is None and "too few" in few["verdict"]
    assert overhead([], [0.1]) is None and overhead([0.1, 0.1], [])["ratio"] is None
    faster = overhead([0.098, 0.097, 0.099], [0.10, 0.10, 0.101, 0.10, 0.099])  # "faster when profiled"
    assert faster["ratio"] == pytest.approx(0.98) and faster["verdict"].endswith(
        ": below 1x is noise, not a speed-up (profiling adds work; what it costs here is smaller than how much one "
        "step's time varies from the next)")
    assert "below 1x" not in quiet["verdict"]


def test_overhead_of_unprofiled_steps_of_no_measurable_time_has_no_ratio():
    """A median of 0 s unprofiled (a clock too coarse for the steps) gives no ratio and says why, in each branch."""
    from oneiter.profile.profile_session import overhead

    zero = [0.0, 0.0, 0.0]
    for profiled, unprofiled in (([0.1], zero), ([0.1, 0.1], zero), ([0.1, 0.1], [0.0, 0.0, 1.0])):
        result = overhead(profiled, unprofiled)
        assert result["ratio"] is None and result["unprofiled_median_s"] == 0.0
        assert result["verdict"] == "unprofiled steps took no measurable time (median 0 s): no ratio"


def test_backward_spans_name_the_root_and_call_n_of_each_module_as_recordings_do(fp32_cli):
    out, _ = fp32_cli
    events = trace_events(sorted(out.glob("*.pt.trace.json.gz"))[0])
    calls: dict[str, set] = {}
    for e in events:
        if e.get("name", "").startswith("oneiter.bwd::"):
            calls.setdefault(e["name"].removeprefix("oneiter.bwd::"), set()).add(e["args"]["call"])
    assert calls["(root)"] == {0} and calls["layer1.0.conv1"] == {0}
    assert calls["layer1.0.relu"] == {0, 1}  # ResNet's shared ReLU: calls 0 and 1 of that module, every step


def test_every_resnet18_leaf_has_forward_and_backward_time(fp32_cli):
    out, _ = fp32_cli
    rows = {r["path"]: r for r in read_summary(out)["cycles"][0]["modules"]}
    from oneiter.runtime.modelspec import load_model

    model = load_model("resnet18", 2, 0, dict(SMALL)).model
    leaves = [p for p, m in model.named_modules() if not list(m.children())]
    assert len(leaves) == RESNET18_LEAVES
    for path in leaves:
        assert rows[path]["leaf"], path
        assert rows[path]["fwd_us"] > 0 and rows[path]["bwd_us"] > 0, path
    assert rows["layer1.0.relu"]["fwd_calls"] == 2  # one ReLU object called twice per block: both calls counted
    assert rows["layer3.0.conv1"]["type"] == "Conv2d"
    assert not any("nn.Module:" in p for p in rows)


def test_memory_table_is_filled_with_profile_memory(fp32_cli):
    out, _ = fp32_cli
    cycle = read_summary(out)["cycles"][0]
    assert cycle["memory"] and all(r["self_cpu_memory"] != 0 for r in cycle["memory"])
    values = [r["self_cpu_memory"] for r in cycle["memory"]]
    assert values == sorted(values, reverse=True)
    rows = {r["path"]: r for r in cycle["modules"]}
    assert rows["layer4.0.conv2"]["bwd_cpu_memory"] > 0  # its weight gradient is allocated during its backward
    tables = (out / cycle["tables"]).read_text()
    assert "== ops ==" in tables and "== memory ==" in tables and "layer4.0.conv2 (Conv2d)" in tables


def test_previous_profile_needs_force(fp32_cli, tmp_path):
    out, _ = fp32_cli
    copy = tmp_path / "again"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "mine.txt").write_text("not oneiter's")
    with pytest.raises(OneIterError, match="--force"):
        prepare_out_dir(copy, force=False)
    prepare_out_dir(copy, force=True)
    assert [f.name for f in copy.iterdir()] == ["mine.txt"]  # only oneiter's own files were removed


# library runs -----------------------------------------------------------------------------------------------
def test_repeat_2_writes_two_traces(tmp_path, capfd):
    result = profile(small_options(tmp_path, schedule="wait=0,warmup=1,active=1,repeat=2", measure_overhead=False))
    assert [c["steps"] for c in result.cycles] == [[1], [3]]
    assert sorted(p.name for p in tmp_path.glob("*.pt.trace.json.gz")) == [
        "resnet18_cpu_rank0_steps1.pt.trace.json.gz",
        "resnet18_cpu_rank0_steps3.pt.trace.json.gz",
    ]
    assert [step_numbers(trace_events(p)) for p in result.traces] == [[1], [3]]
    assert result.overhead is None and result.cycles[0]["memory"] == []
    captured = capfd.readouterr()
    assert "USDT" not in captured.out + captured.err  # Kineto's native lines are filtered at the fd level


def test_module_ranges_do_not_change_the_numbers():
    from oneiter.runtime.modelspec import load_model
    from oneiter.runtime.training import prepare, train_step

    def grads(with_ranges: bool):
        bundle = load_model("resnet18", 2, 0, dict(SMALL))
        setup = prepare(bundle, torch.device("cpu"))
        seen = {}

        def after_backward():
            seen.update({n: p.grad.clone() for n, p in bundle.model.named_parameters()})

        if with_ranges:
            with ModuleRanges(bundle.model):
                loss = train_step(setup, after_backward=after_backward)
            assert not bundle.model._forward_hooks and not bundle.model._forward_pre_hooks  # all removed
        else:
            loss = train_step(setup, after_backward=after_backward)
        return loss, seen

    loss_a, grads_a = grads(True)
    loss_b, grads_b = grads(False)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_trace_names_are_readable():
    assert trace_stem("resnet18", "cuda:1", 3, [5, 6]) == "resnet18_cuda1_rank3_steps5-6"
    stem = trace_stem("models/my_net.py:build", "cpu", 0, [2], "bfloat16", "bf16")
    assert stem == "my_net-build_cpu_rank0_bfloat16_amp-bf16_steps2"


# diff -------------------------------------------------------------------------------------------------------
def test_a_diff_ratio_keeps_four_significant_digits_however_small():
    """A module 360x faster on one side (a loaded machine's first profile: 172,390 us against 476 us) kept its ratio as
    0.0028 when ratios were rounded to 4 decimals, 1.5 % off the measured 0.0027594."""
    assert _ratio(172390.5955, 475.694) == 0.002759 and _ratio(100.0, 123456.0) == 1235.0
    assert _ratio(0.0, 5.0) is None


def test_diff_float32_vs_bfloat16_aligns_modules(fp32_cli, bf16_dir):
    out, _ = fp32_cli
    diff = diff_profiles(out, bf16_dir)
    assert diff.module_alignment >= 0.95
    assert len(diff.modules) == 68  # every module path of resnet18, root included
    row = next(r for r in diff.modules if r["path"] == "layer3.0.conv1")
    assert row["a_us"] > 0 and row["b_us"] > 0 and row["ratio"] == pytest.approx(row["b_us"] / row["a_us"], rel=1e-3)
    assert row["a_memory"] > 0 and row["b_memory"] > 0
    assert diff.b["dtype"] == "bfloat16"
    text = format_diff(diff, limit=None)  # every row: which rows a limit keeps depends on the measured times
    assert text.startswith("step time B/A") and "layer" in text
    # leaves and containers ranked apart: the model itself (a container) cannot top the leaves' list
    leaves = {r["path"] for r in diff.modules if r["leaf"]}
    assert "layer3.0.conv1" in leaves and not {"", "layer3", "layer3.0"} & leaves
    assert len(leaves) == 52  # of 68 paths: 16 containers
    leaf_part, _, container_part = text.partition("== containers (their time includes their children's)")
    assert "== leaf modules: ms per step, sorted by delta ==" in leaf_part and "(root)" in container_part
    assert "(root)" not in leaf_part and "(ResNet)" not in leaf_part


def test_cli_diff_writes_json(fp32_cli, bf16_dir, tmp_path):
    out, _ = fp32_cli
    result = CliRunner().invoke(profile_cmd.app, ["diff", str(out), str(bf16_dir), "--json", str(tmp_path / "d.json")])
    assert result.exit_code == 0, result.output + result.stderr
    assert "modules aligned" in result.stdout
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["module_alignment"] >= 0.95 and data["modules"]


def test_cli_diff_of_a_non_profile_exits_2(tmp_path, fp32_cli):
    out, _ = fp32_cli
    result = CliRunner().invoke(profile_cmd.app, ["diff", str(out), str(tmp_path)])
    assert result.exit_code == 2 and "not a oneiter profile" in result.stderr


def test_help_shows_an_example():
    result = CliRunner().invoke(profile_cmd.app, ["--help"])
    assert result.exit_code == 0 and "oneiter profile --model resnet18" in result.stdout
    result = CliRunner().invoke(profile_cmd.app, ["diff", "--help"])
    assert result.exit_code == 0 and "oneiter profile diff" in result.stdout


def test_large_trace_and_misleading_settings_are_warned_before_the_run(tmp_path):
    from oneiter.profile.run_parts import option_warnings

    small = option_warnings(small_options(tmp_path), parse_schedule("wait=1,warmup=1,active=2"), 68)
    assert small == []
    big = option_warnings(small_options(tmp_path, with_stack=True), parse_schedule("warmup=0,active=40"), 68)
    assert any("large trace ahead" in w for w in big)
    assert any("warmup=0" in w for w in big) and any("--with-stack" in w for w in big)
