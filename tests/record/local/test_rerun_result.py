"""One call's rerun returns its result as a value (`record/local/rerun.py`: `Rerunner.run` -> `RunResult`), each
field named for what it holds, on a Conv2d -> BatchNorm2d model replayed teacher-forced on the CPU: a BatchNorm
call's rerun gives the running statistics it updated (`changed_buffers`, bitwise the live iteration's) and its
weight's and bias's gradient contributions (`grad_contributions`); a convolution's rerun changes no buffer; the
container's rerun, whose own code only hands each child's output to the next, produced nothing of its own
(`passed_on` holds every value but its backward's seed)."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest
from conftest import MODEL_FILES, record_small, replay

from oneiter.format.schema import BACKWARD, FORWARD
from oneiter.record.local.rerun import Rerunner

ZOO = str(MODEL_FILES / "zoo_models.py:build")
CONV_BN = {"name": "nn_conv2d"}  # 0 Conv2d, 1 BatchNorm2d, 2 ReLU(inplace), 3 Conv2d, 4 BatchNorm2d, ...


@pytest.fixture(scope="module")
def reruns(tmp_path_factory):
    """The primary rerun of every call of a teacher-forced replay, by call key; and the replay's file."""
    out = tmp_path_factory.mktemp("rerun_result")
    record_small(out / "ref.h5", ZOO, threads=1, model_args=CONV_BN)
    seen, run = {}, Rerunner.run

    def spy(self, rec, site, forced):
        result = run(self, rec, site, forced)
        if site.name == "target":
            seen[rec.key] = result
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Rerunner, "run", spy)
        replay(out / "ref.h5", out / "tgt.h5", threads=1)
    return seen, out / "tgt.h5"


def test_a_batchnorm_rerun_names_the_running_statistics_it_changed(reruns):
    seen, target = reruns
    bn = seen["1@0"]
    assert set(bn.changed_buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert set(bn.grad_contributions) == {"1.weight", "1.bias"}
    assert set(bn.forward) == {"output"} and set(bn.backward) == {"grad_input.0"} and bn.passed_on == set()
    with h5py.File(target) as f:
        for name in ("1.running_mean", "1.running_var"):
            assert np.array_equal(bn.changed_buffers[name].numpy(), f[f"state_after/{name}"][()]), name


def test_a_convolution_rerun_changes_no_buffer(reruns):
    conv = reruns[0]["0@0"]
    assert conv.changed_buffers == {} and set(conv.grad_contributions) == {"0.weight", "0.bias"}
    assert conv.backward == {}  # the batch takes no gradient


def test_a_container_that_only_hands_values_on_produced_nothing_of_its_own(reruns):
    root = reruns[0]["(root)@0"]
    assert {"0@0:input.0", "10@0:input.0", "output"} <= set(root.forward) and "9@0:grad_output" in root.backward
    every = {(FORWARD, n) for n in root.forward} | {(BACKWARD, n) for n in root.backward}
    # all but the gradient it hands its last child: that is the seed of its backward, the source's own gradient
    assert every - root.passed_on == {(BACKWARD, "10@0:grad_output")}
    assert root.grad_contributions == {} and root.changed_buffers == {}


def test_a_rerun_result_is_a_value(reruns):
    with pytest.raises(dataclasses.FrozenInstanceError):
        reruns[0]["1@0"].changed_buffers = {}
