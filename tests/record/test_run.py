"""`record(SpecOptions(...))`: building a model from its spec and recording one iteration of it."""

import numpy as np
from conftest import MODEL_FILES

from oneiter.format.layout import IterationFile
from oneiter.record.run import SpecOptions, record

TWICE = f"{MODEL_FILES / 'twice.py'}:build"


def test_seed_none_leaves_the_iterations_rng_alone_and_builds_with_seed_zero(tmp_path):
    """seed=None is legal (the iteration's RNG is left alone): the model and batch are still built with seed 0,
    bit for bit those of a recording with the default seed."""
    record(SpecOptions(out=tmp_path / "none.h5", model=TWICE, batch_size=2, seed=None))
    record(SpecOptions(out=tmp_path / "zero.h5", model=TWICE, batch_size=2, seed=0))
    with IterationFile(tmp_path / "none.h5") as none, IterationFile(tmp_path / "zero.h5") as zero:
        assert int(none.meta["seed"]) == 0
        state = none.state()
        assert state and state.keys() == zero.state().keys()
        for name, path in state.items():
            np.testing.assert_array_equal(none.raw(path), zero.raw(zero.state()[name]), err_msg=name)
        assert none.batch_paths() == zero.batch_paths()
        for path in none.batch_paths():
            np.testing.assert_array_equal(none.raw(path), zero.raw(path), err_msg=path)
