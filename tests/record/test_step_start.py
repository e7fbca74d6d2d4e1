"""A parameter the model writes itself during the iteration (nn.Embedding(max_norm) renormalises the rows it looks
up, in place, in forward) is stored as the optimizer step found it (`/step_start`), and a replay's optimizer row
starts from there: the update of such a parameter is judged from where it started, not from `state_before`."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import MODEL_FILES, compare_verdict, record_small, replay, run_cli

from oneiter.format.layout import IterationFile

ZOO = f"{MODEL_FILES / 'zoo_models.py'}:build"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_start") / "ref.h5"
    record_small(out, ZOO, model_args={"name": "nn_embedding"})
    return out


def test_only_the_written_parameter_is_stored_where_its_step_started(reference):
    with h5py.File(reference) as f:
        assert list(f["step_start"]) == ["embed.weight"]
        before, start = f["state_before/embed.weight"][()], f["step_start/embed.weight"][()]
    norms = np.linalg.norm(start, axis=-1)
    assert (np.linalg.norm(before[1:], axis=-1) > 1).all() and (norms <= 1 + 1e-6).any() and (norms > 1).any()


@pytest.mark.parametrize("options", [{}, {"amp": "bf16"}], ids=["same", "bf16"])
def test_a_clean_replay_is_a_match(reference, tmp_path, options):
    tgt = tmp_path / "tgt.h5"
    replay(reference, tgt, **options)
    code, verdict = compare_verdict(reference, tgt, tmp_path)
    assert code == 0 and verdict["status"] == "match" and verdict["basis"] == "local_error", verdict


def test_a_step_start_for_no_parameter_is_refused(reference, tmp_path):
    forged = tmp_path / "forged.h5"
    forged.write_bytes(reference.read_bytes())
    with h5py.File(forged, "r+") as f:
        f.move("step_start/embed.weight", "step_start/nowhere.weight")
    res = run_cli("inspect", forged)
    assert res.exit_code == 2 and res.stderr.strip().endswith("/step_start/nowhere.weight: no parameter of the file")
    with pytest.raises(Exception, match="no parameter of the file"):
        IterationFile(forged).__enter__()
