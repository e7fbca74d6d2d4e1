"""The mmengine hooks: a real Runner trains a toy model on CPU with `custom_hooks`, records and replays."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("mmengine")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import assert_reads_back  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.runner import Runner  # noqa: E402
from torch import nn  # noqa: E402

import oneiter.integrations.mmengine as integration  # noqa: E402  (registers the hooks)
from oneiter.errors import OneIterError  # noqa: E402
from oneiter.format.layout import IterationFile  # noqa: E402
from oneiter.judge.iteration.engine import compare_files  # noqa: E402
from oneiter.record.options import RecordOptions  # noqa: E402


class ToyNet(BaseModel):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8, 4)

    def forward(self, inputs, data_samples=None, mode="tensor"):
        x = self.relu(self.bn(self.conv(inputs)))
        logits = self.fc(self.drop(x.mean(dim=(2, 3))))
        if mode == "loss":
            return {"loss_cls": F.cross_entropy(logits, data_samples), "loss_reg": 0.1 * logits.pow(2).mean()}
        return logits


def build(batch_size):
    """The model contract, for `oneiter replay --layer` of what the hook records (this file as the model file)."""
    data = ToyData(0)
    return ToyNet(), (data.images[:batch_size],), lambda out: out.square().mean()


class ToyData(torch.utils.data.Dataset):
    def __init__(self, seed: int, size: int = 16):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, 8, 8, generator=gen)
        self.labels = torch.randint(0, 4, (size,), generator=gen)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"inputs": self.images[i], "data_samples": self.labels[i]}


def train(work_dir: Path, hooks: list, *, model_seed: int = 0, data_seed: int = 0, fault=None, max_iters: int = 3,
          accumulative_counts: int = 1, **runner_args):
    torch.manual_seed(model_seed)
    model = ToyNet()
    if fault is not None:
        fault(model)
    runner = Runner(
        model=model, work_dir=str(work_dir), experiment_name=f"oneiter-{uuid.uuid4().hex[:8]}",
        train_dataloader=dict(
            dataset=ToyData(data_seed), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=4,
            num_workers=0, collate_fn=dict(type="default_collate"),
        ),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1), accumulative_counts=accumulative_counts),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=1000),
        default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=1)),
        custom_hooks=hooks, log_level="WARNING", default_scope=None, **runner_args,
    )
    runner.train()
    return runner


def record_hook(out: Path, **kwargs) -> dict:
    return dict(type="OneIterRecordHook", iteration=1, out=str(out), **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("mmengine")
    train(tmp / "ref", [record_hook(tmp / "ref.h5")])
    return tmp / "ref.h5"


def test_record_hook_writes_a_complete_recording(reference):
    with IterationFile(reference) as f:
        assert f.meta["model"] == "ToyNet" and f.meta["iteration"] == 1 and f.meta["framework"] == "mmengine"
        assert f.meta["batch_size"] == 4 and f.meta["optimizer"] == "sgd"
        assert [f.attrs(p)["arg"] for p in f.batch_paths()] == ["kwarg.inputs", "kwarg.data_samples"]
        assert f.tensor("batch/input.0").shape == (4, 3, 8, 8)
        modules = [attrs["module"] for _, attrs in f.calls()]
        assert modules == ["", "conv", "bn", "relu", "drop", "fc"]  # no data_preprocessor call
        assert set(f.state()) == set(f.state("state_after")) and len(f.state("param_grads")) == 6
        assert set(__import__("json").loads(f.meta["loss_dict"])) == {"loss", "loss_cls", "loss_reg"}
        assert float(f.read("loss")) == pytest.approx(f.meta["loss"])
        # the batch is iteration 1's: samples 4..7 of the dataset, as the preprocessor delivered them
        assert torch.equal(f.tensor("batch/input.0"), ToyData(0).images[4:8])


def test_the_hooks_file_reads_back(reference):
    """`inspect`, `compare` and `replay --layer` (this file's `build` as the model file) take it."""
    assert_reads_back(reference, "conv", f"{Path(__file__).resolve()}:build")


def test_replay_matches_the_reference_bit_for_bit(reference, tmp_path):
    target = tmp_path / "tgt.h5"
    # another model init and other data: only the replay can make iteration 1 identical
    train(tmp_path / "tgt", [record_hook(target, replay=str(reference))], model_seed=1, data_seed=1)
    result = compare_files(reference, target)
    assert result.status == "match", result.verdict()
    assert result.rows and all(row.metrics.max_abs == 0 for row in result.rows)
    with IterationFile(target) as f:
        assert f.meta["replay_of"] == str(reference) and f.meta["local"] == "teacher_forced"


def test_replay_with_a_fault_names_the_faulty_module(reference, tmp_path):
    def scale_bn(model):
        model.bn.register_forward_hook(lambda _m, _args, out: out * 1.01)

    target = tmp_path / "fault.h5"
    train(tmp_path / "fault", [record_hook(target, replay=str(reference), isolate=False)], fault=scale_bn)
    verdict = compare_files(reference, target).verdict()
    assert verdict["status"] == "diverged"
    assert (verdict["module"], verdict["phase"], verdict["tensor"]) == ("bn", "forward", "output")


def test_record_hook_arguments_are_checked(tmp_path, reference):
    with pytest.raises(ValueError, match="iteration should be a non-negative int, but got -1"):
        integration.OneIterRecordHook(iteration=-1, out=tmp_path / "x.h5")
    with pytest.raises(FileExistsError, match="force=True"):
        integration.OneIterRecordHook(iteration=0, out=reference)
    with pytest.raises(ValueError, match="include/exclude"):
        integration.OneIterRecordHook(iteration=0, out=tmp_path / "x.h5", include="(")
    with pytest.raises(ValueError, match=r"less than the number of training iterations \(3\)"):
        train(tmp_path / "late", [dict(type="OneIterRecordHook", iteration=3, out=str(tmp_path / "late.h5"))])


def test_record_hook_takes_its_settings_as_record_options(reference, tmp_path):
    """`options=RecordOptions(...)`, as a Python caller gives them: the same recording as the keywords make (here a
    statistics-level replay of the reference), the preprocessor still skipped; the framework's autocast is not a
    setting."""
    options = RecordOptions(out=tmp_path / "stats.h5", replay=reference, level="stats", meta={"run": "nightly"})
    hook = integration.OneIterRecordHook(iteration=1, options=options)
    assert hook.options.skip == ("data_preprocessor",) and hook.options.manage_autocast is False
    train(tmp_path / "stats", [hook], model_seed=1, data_seed=1)
    with IterationFile(tmp_path / "stats.h5") as f:
        assert (f.meta["level"], f.meta["replay_of"], f.meta["run"], f.meta["framework"]) == (
            "stats", str(reference), "nightly", "mmengine")
        assert [attrs["module"] for _, attrs in f.calls()] == ["", "conv", "bn", "relu", "drop", "fc"]
    assert compare_files(reference, tmp_path / "stats.h5").status == "match"
    with pytest.raises(ValueError, match="takes options= or the recording's keywords"):
        integration.OneIterRecordHook(iteration=1, options=options, seed=3)
    with pytest.raises(ValueError, match="amp is the training framework's own"):
        integration.OneIterRecordHook(iteration=1, out=tmp_path / "x.h5", amp="bf16")
    with pytest.raises(TypeError, match="unexpected keyword argument 'seeds'"):
        integration.OneIterRecordHook(iteration=1, out=tmp_path / "x.h5", seeds=3)


def test_failed_iteration_leaves_no_file_and_no_hooks(tmp_path):
    out = tmp_path / "boom.h5"
    seen = {}

    def explode_in_fc(model):
        seen["model"] = model

        def boom(_m, _args):
            if model.training and seen.setdefault("calls", 0) == 1:
                raise RuntimeError("boom")
            seen["calls"] = seen.get("calls", 0) + 1

        model.fc.register_forward_pre_hook(boom)

    with pytest.raises(RuntimeError, match="boom"):
        train(tmp_path / "boom", [dict(type="OneIterRecordHook", iteration=1, out=str(out))], fault=explode_in_fc)
    model = seen["model"]
    assert not out.exists() and not list(tmp_path.glob(".boom.h5.tmp-*"))
    assert "train_step" not in model.__dict__
    assert all(len(m._forward_pre_hooks) == (1 if m is model.fc else 0) for m in model.modules())
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_profiler_hook_writes_one_trace_per_cycle(tmp_path):
    from oneiter.profile.summary import read_summary
    from oneiter.profile.trace import read_trace

    out_dir = tmp_path / "prof"
    hook = dict(type="OneIterProfilerHook", schedule="wait=0,warmup=1,active=1", out_dir=str(out_dir))
    train(tmp_path / "run", [hook])
    traces = sorted(out_dir.glob("*.pt.trace.json.gz"))
    assert [t.name for t in traces] == ["ToyNet_cpu_rank0_steps1.pt.trace.json.gz"]
    summary = read_summary(out_dir)
    assert len(summary["cycles"]) == 1 and summary["cycles"][0]["steps"] == [1]
    assert summary["framework"] == "mmengine" and summary["first_iter"] == 0
    o = summary["overhead"]  # one recorded step: a ratio would be noise, and it says so
    assert (o["num_profiled"], o["ratio"]) == (1, None) and "too few" in o["verdict"]
    modules = {row["path"]: row for row in summary["cycles"][0]["modules"]}
    assert all(modules[m]["fwd_calls"] == 1 and modules[m]["bwd_calls"] == 1 for m in ("conv", "bn", "fc"))
    names = {e.get("name", "") for e in read_trace(traces[0])["traceEvents"]}
    assert "oneiter.fwd::conv" in names and "oneiter.bwd::conv" in names


def test_profiler_hook_refuses_an_unreachable_schedule(tmp_path):
    with pytest.raises(ValueError, match="schedule should be like"):
        integration.OneIterProfilerHook(schedule="active=0")
    hook = dict(type="OneIterProfilerHook", schedule="wait=2,warmup=1,active=1", out_dir=str(tmp_path / "p"))
    with pytest.raises(ValueError, match="needs 4 iterations and only 3 remain"):
        train(tmp_path / "run", [hook])


def test_an_existing_instance_train_step_is_kept(tmp_path):
    """mmengine's compile=True stores the compiled train_step on the instance: the hook must call and restore it."""
    calls = []

    def keep_compiled(model):
        original = model.train_step
        model.train_step = lambda *a, **k: calls.append(1) or original(*a, **k)
        calls.append(model.__dict__["train_step"])

    runner = train(tmp_path / "run", [record_hook(tmp_path / "c.h5")], fault=keep_compiled)
    assert (tmp_path / "c.h5").exists() and len(calls) == 1 + 3
    assert runner.model.__dict__["train_step"] is calls[0]


def test_batch_names_and_swap_reach_into_data_elements():
    from mmengine.structures import BaseDataElement

    from oneiter.record.capture.batch import BatchSwap, map_call

    sample = BaseDataElement(metainfo=dict(img_id=3), gt_label=torch.tensor([1, 2]))
    names = []
    map_call((torch.zeros(2),), {"data_samples": [sample], "mode": "loss"}, lambda n, t: names.append(n) or t)
    assert names == ["input.0", "kwarg.data_samples.0.gt_label"]
    swap = BatchSwap({"input.0": torch.ones(2), "kwarg.data_samples.0.gt_label": torch.tensor([7, 8])}, "ref.h5")
    args, kwargs = map_call((torch.zeros(2),), {"data_samples": [sample], "mode": "loss"}, swap)
    swap.check_complete()
    assert torch.equal(args[0], torch.ones(2)) and kwargs["data_samples"][0] is sample
    assert sample.gt_label.tolist() == [7, 8] and kwargs["mode"] == "loss"
    with pytest.raises(OneIterError, match=r"shape \[3\] in the reference"):
        map_call((torch.zeros(2),), {}, BatchSwap({"input.0": torch.ones(3)}, "ref.h5"))


def test_every_k_iterations_records_their_statistics_and_a_replay_matches(tmp_path):
    """`every=2` over 5 iterations: 0, 2 and 4 in one multi-step file. A replay from other initial weights starts
    from the reference's state at 0 and takes its batches and dropout masks at 0, 2, 4 (the iterations between are
    its own, with the same data and seed): every recorded step is the reference's bit for bit. No twin in a runner:
    the verdict holds the steps to the tolerance and says so."""
    import oneiter

    hook = dict(type="OneIterRecordHook", every=2, out=str(tmp_path / "ref.h5"))
    seeded = dict(max_iters=5, randomness=dict(seed=0))
    train(tmp_path / "ref", [hook], **seeded)
    train(tmp_path / "tgt", [{**hook, "out": str(tmp_path / "tgt.h5"), "replay": str(tmp_path / "ref.h5")}],
          model_seed=1, **seeded)
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert [r.step for r in result.rows] == [0, 2, 4] and all(r.bitwise for r in result.rows)
    assert (result.exit_code, result.verdict()["basis"]) == (0, "tolerance")
    with pytest.raises(ValueError, match="one of iteration and every should be given, but got both"):
        integration.OneIterRecordHook(iteration=1, every=2, out=tmp_path / "x.h5")


# -- gradient accumulation: OptimWrapper(accumulative_counts=2) steps every second iteration ---------------------------
@pytest.fixture(scope="module")
def window_ref(tmp_path_factory) -> Path:
    """`iteration=3` under `accumulative_counts=2`: iteration 3 is the second of the window 2..3 its step closes, so
    the hook records both iterations as one iteration of two microbatches."""
    tmp = tmp_path_factory.mktemp("mmengine_window")
    train(tmp / "ref", [dict(type="OneIterRecordHook", iteration=3, out=str(tmp / "ref.h5"))], max_iters=4,
          accumulative_counts=2)
    return tmp / "ref.h5"


def test_an_iteration_inside_an_accumulation_window_records_the_whole_window(window_ref, tmp_path):
    with IterationFile(window_ref) as f:
        assert (f.microbatches(), f.meta["iteration"]) == (2, 3)
        assert len(f.batch_paths(0)) == len(f.batch_paths(1)) == 2  # inputs and data_samples of each iteration
        assert [len(d) for d in __import__("json").loads(f.meta["loss_dict"])] == [3, 3]
    target = tmp_path / "tgt.h5"
    train(tmp_path / "tgt", [{**record_hook(target, replay=str(window_ref)), "iteration": 3}], max_iters=4,
          accumulative_counts=2, model_seed=1, data_seed=1)
    result = compare_files(window_ref, target)
    assert result.status == "match", result.verdict()
    assert all(row.metrics.max_abs == 0 for row in result.rows)  # both iterations' batches and dropout masks swapped


def test_a_fault_in_an_accumulation_window_is_named_with_its_microbatch(window_ref, tmp_path):
    def scale_fc(model):
        model.fc.register_forward_hook(lambda _m, _args, out: out * 1.001)

    target = tmp_path / "fault.h5"
    train(tmp_path / "fault", [{**record_hook(target, replay=str(window_ref)), "iteration": 2}], max_iters=4,
          accumulative_counts=2, model_seed=1, data_seed=1, fault=scale_fc)
    verdict = compare_files(window_ref, target).verdict()
    assert (verdict["status"], verdict["basis"], verdict["module"], verdict["phase"]) == (
        "diverged", "local_error", "fc", "forward")
    assert verdict["culprit"]["microbatch"] == 0


def test_every_k_windows_are_screened_and_every_must_be_a_multiple_of_the_window(tmp_path):
    import oneiter

    hook = dict(type="OneIterRecordHook", every=2, out=str(tmp_path / "ref.h5"))
    seeded = dict(max_iters=4, randomness=dict(seed=0), accumulative_counts=2)
    train(tmp_path / "ref", [hook], **seeded)
    train(tmp_path / "tgt", [{**hook, "out": str(tmp_path / "tgt.h5"), "replay": str(tmp_path / "ref.h5")}],
          model_seed=1, **seeded)
    result = oneiter.compare(tmp_path / "ref.h5", tmp_path / "tgt.h5")
    assert [r.step for r in result.rows] == [0, 2] and all(r.bitwise for r in result.rows)
    with IterationFile(tmp_path / "tgt.h5") as f:
        assert [f.step(s).microbatches() for s in f.steps()] == [2, 2]
    with pytest.raises(ValueError, match=r"every should be a multiple of the optimizer wrapper's accumulative_counts "
                                         r"\(2: each recorded step is a window of 2 iterations\), but got 3"):
        train(tmp_path / "odd", [{**hook, "every": 3, "out": str(tmp_path / "odd.h5")}], **seeded)
