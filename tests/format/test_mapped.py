"""Reading recorded tensors through a private mapping of their bytes (`format/mapped.py`) instead of h5py's copy."""

from __future__ import annotations

import gc

import h5py
import numpy as np
import pytest

from oneiter.errors import FormatError
from oneiter.format.layout import IterationFile
from oneiter.format.mapped import MappedReader
from oneiter.format.validate import check_tree


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def test_every_tensor_of_a_real_recording_reads_back_bitwise_and_large_ones_are_mapped(resnet_ref):
    with IterationFile(resnet_ref) as f, h5py.File(resnet_ref) as plain:
        mapped = 0
        for entry in f.entries():
            got, want = f.raw(entry.path), plain[entry.path][()]
            assert got.dtype == want.dtype and got.shape == want.shape, entry.path
            assert got.tobytes() == want.tobytes(), entry.path
            if got.nbytes >= 64 << 10:
                assert not got.flags.owndata and got.flags.writeable, entry.path  # a mapping, not a copy
                mapped += 1
        weight = "state_before/layer4.1.conv2.weight"
        assert f.raw(weight).nbytes == 512 * 512 * 9 * 4 and not f.raw(weight).flags.owndata
    assert mapped >= 10


def test_writing_into_a_mapped_array_never_changes_the_file(resnet_ref):
    path = "state_before/layer4.1.conv2.weight"
    with h5py.File(resnet_ref) as plain:
        before = plain[path][()].tobytes()
    with IterationFile(resnet_ref) as f:
        array = f.raw(path)
        array[...] = 7.0  # copy-on-write: this process's private pages only
        assert f.raw(path).tobytes() == before  # a new read maps the file's bytes again
        assert float(array.reshape(-1)[0]) == 7.0
    with h5py.File(resnet_ref) as plain:
        assert plain[path][()].tobytes() == before


def test_a_mapping_is_released_with_the_last_array_viewing_it(resnet_ref):
    import torch

    from oneiter.format.schema import to_torch

    with IterationFile(resnet_ref) as f:
        f.raw("state_before/layer4.1.conv2.weight")  # first use: the reader's own setup is not counted
        gc.collect()
        baseline = _mappings()
        tensors = [to_torch(f.raw(f"state_before/layer4.{i}.conv2.weight"), "float32") for i in range(2)]
        assert _mappings() >= baseline + 2
        view = tensors[0][3:5]  # a view keeps its mapping alive
        expected = view.clone()
        del tensors
        gc.collect()
        assert torch.equal(view, expected)
        del view
        gc.collect()
        assert _mappings() == baseline


def test_data_past_the_end_of_the_file_is_refused_not_mapped(resnet_ref):
    with h5py.File(resnet_ref) as plain:
        stored = check_tree(plain, resnet_ref).datasets["state_before/layer4.1.conv2.weight"]
        reader = MappedReader(resnet_ref)
        reader._size = stored.offset + 512 * 512 * 9 * 4 - 1  # as if the file were cut inside this dataset
        with pytest.raises(FormatError, match="past the end of the file"):
            reader.array(stored, "that dataset")
        reader.close()


def test_chunked_compressed_small_and_foreign_order_datasets_are_left_to_h5py(tmp_path):
    path = tmp_path / "plain.h5"
    data = np.arange(1 << 16, dtype=np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("chunked", data=data, chunks=(4096,), compression="gzip")
        f.create_dataset("small", data=data[:100])
        f.create_dataset("big_endian", data=data.astype(">f4"))
        f.create_dataset("contiguous", data=data)
    reader = MappedReader(path)
    with h5py.File(path) as f:
        tree = check_tree(f, path)
    assert tree.datasets["chunked"].offset is None  # the walk gives only contiguous, unfiltered data an offset
    for name in ("chunked", "small", "big_endian"):
        assert reader.array(tree.datasets[name], name) is None, name
    assert reader.array(tree.datasets["contiguous"], "contiguous").tobytes() == data.tobytes()
    reader.close()


def test_readers_answer_from_the_validation_walk_not_from_hdf5(resnet_ref):
    """Opening a file walks it once (`validate.check_tree`); links, attributes, shapes, dtypes, identities and the
    mapped reads of large tensors come from what the walk kept. Any lookup through h5py here fails the test."""
    with IterationFile(resnet_ref) as f:
        real = f.file

        class NoLookups:
            def __getattr__(self, name):
                raise AssertionError(f"h5py asked for {name}")

            def __getitem__(self, key):
                raise AssertionError(f"h5py asked for {key}")

            def __contains__(self, key):
                raise AssertionError(f"h5py asked for {key}")

        f.file = NoLookups()
        try:
            entries = list(f.entries())
            calls = f.calls()
            state = f.state()
            weight = state["layer4.1.conv2.weight"]
            assert f.dtype_of(weight) == "float32" and f.shape_of(weight) == (512, 512, 3, 3)
            assert f.raw(weight).tobytes() == real[weight][()].tobytes()
            assert f.has(weight) and f.has("calls") and not f.has("calls/nothing")
            assert f.attrs(weight) == {"dtype": "float32"}
            assert f.attrs(f"calls/{calls[0][0]}")["exec_index"] == 0
            order = sorted(real["calls"].keys(), key=lambda k: real["calls"][k].attrs["exec_index"])
            assert [name for name, _ in calls] == order
            assert f.dataset_id(weight) == f.dataset_id(weight) != f.dataset_id(state["layer4.1.conv1.weight"])
        finally:
            f.file = real
        assert len(entries) > 100
        # two names hard-linked to one dataset (an output that is the next call's input) share one identity
        by_id = {}
        for entry in entries:
            by_id.setdefault(f.dataset_id(entry.path), []).append(entry.path)
        linked = [paths for paths in by_id.values() if len(paths) > 1]
        assert linked and all(real[p[0]].id == real[p[1]].id for p in linked)
