"""`RecordOptions`: a recording's settings checked once, with errors that name the parameter; `SpecOptions` on top
for `oneiter record`; the Recorder's progress as one `Phase`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest
import torch

from oneiter.errors import OneIterError
from oneiter.record.local.probe import AgainstCpuProbe, LocalProbe, TeacherForcedProbe
from oneiter.record.options import CALIBRATIONS, LEVELS, RecordOptions
from oneiter.record.recorder import Phase, Recorder
from oneiter.record.run import Dtype, OptimizerName, SpecOptions
from oneiter.runtime.precision import DTYPES
from oneiter.runtime.training import OPTIMIZERS


def test_the_literals_are_the_choices_runtime_accepts():
    assert get_args(Dtype) == DTYPES and get_args(OptimizerName) == OPTIMIZERS
    assert LEVELS == ("full", "stats") and CALIBRATIONS == ("cpu", "device")


@pytest.mark.parametrize("kwargs, param, message", [
    ({"amp": "fp8"}, "amp", r"^amp must be one of bf16, fp16 \(or None\), got 'fp8'$"),
    ({"level": "some"}, "level", r"^level takes full or stats, got 'some'$"),
    ({"calibrate": "gpu"}, "calibrate", r"^calibrate takes 'cpu' or 'device'"),
    ({"against": "gpu"}, "against", r"^against takes 'cpu'"),
    ({"against": "cpu", "replay": "ref.h5"}, "against", r"^against='cpu' needs no reference"),
    ({"against": "cpu", "level": "stats"}, "level", r"^level='stats' keeps no tensor data"),
    ({"include": "("}, "include", r"^include has a bad regular expression"),
    ({"exclude": 3}, "exclude", r"^exclude must be None, a regex string or a list of them, got 3$"),
    ({"seed": 1.5}, "seed", r"^seed must be an int or None, got 1\.5$"),
    ({"out": 3}, "out", r"^out must be a file path \(str or PathLike\), got 3$"),
])
def test_errors_name_the_parameter(kwargs, param, message):
    with pytest.raises(OneIterError, match=message) as info:
        RecordOptions(**{"out": "x.h5", **kwargs})
    assert info.value.param == param


def test_values_are_normalised_once_and_replace_checks_again():
    opts = RecordOptions(out="x.h5", amp="torch.bfloat16", include=r"^layer1\.", skip=["pre"], meta=None)
    got = (opts.out, opts.amp, opts.include, opts.skip, opts.meta)
    assert got == (Path("x.h5"), "bf16", [r"^layer1\."], ("pre",), {})
    assert replace(opts, amp="float16").amp == "fp16" and replace(opts) == opts
    with pytest.raises(OneIterError, match="^amp must be one of"):
        replace(opts, amp="int8")
    select = opts.selector()
    assert select("layer1.0") and not select("layer2") and not select("pre.layer1.x")


def test_spec_options_check_the_spec_choices_with_the_runtime_messages():
    with pytest.raises(OneIterError, match="^--dtype must be one of float32, bfloat16, float16, float64, got 'int8'$"):
        SpecOptions(out="x.h5", dtype="int8")
    with pytest.raises(OneIterError, match="^--optimizer must be one of sgd, adamw, got 'lbfgs'$"):
        SpecOptions(out="x.h5", optimizer="lbfgs")
    assert isinstance(SpecOptions(out="x.h5", model="resnet18"), RecordOptions)


def test_the_two_probe_strategies_share_one_base():
    assert issubclass(TeacherForcedProbe, LocalProbe) and issubclass(AgainstCpuProbe, LocalProbe)
    assert (TeacherForcedProbe.KIND, AgainstCpuProbe.KIND) == ("teacher_forced", "against_cpu")


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4)


def test_the_phase_moves_forward_with_the_iteration(tmp_path):
    model, opt, x = _tiny()
    rec = Recorder(model, tmp_path / "a.h5", optimizer=opt)
    seen = [rec.phase]
    with rec:
        seen.append(rec.phase)
        loss = model(rec.inputs(x)).sum()
        seen.append(rec.phase)
        loss.backward()  # the gradients are read when it returns
        seen.append(rec.phase)
        opt.step()
        seen.append(rec.phase)
        model(x).sum().backward()  # a second forward and backward change nothing
        seen.append(rec.phase)
    seen.append(rec.phase)
    assert seen == [Phase.IDLE, Phase.OPEN, Phase.FORWARD, Phase.GRADS, Phase.STEPPED, Phase.STEPPED, Phase.CLOSED]
    with pytest.raises(OneIterError, match="records one block"):
        with rec:
            pass


def test_a_backward_before_the_model_ran_has_no_batch(tmp_path):
    model, _, x = _tiny()
    with pytest.raises(OneIterError, match="the model was never called inside the Recorder block") as info:
        with Recorder(model, tmp_path / "a.h5"):
            (x * torch.ones(4, requires_grad=True)).sum().backward()
    assert info.value.param == "model" and not list(tmp_path.iterdir())
