"""Hostile files: what `IterationFile` refuses before anything reads it, through every reader, with one line.

The recordings are the small MLP set of `mutants.make_pair` (reference, replay target, plain second recording).
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import h5py
import numpy as np
import pytest
from conftest import run_cli

from oneiter.errors import FormatError, OneIterError
from oneiter.format.layout import IterationFile


@pytest.fixture(scope="session")
def pair(mlp_pair):
    return mlp_pair  # the MLP recordings, made once per session (conftest)


def one_line_error(res) -> str:
    """Exit 2, exactly one line on stderr starting `error:`, no traceback; returns the line."""
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def mutate(pair, tmp_path, edit, base: str = "target", name: str = "bad.h5"):
    path = tmp_path / name
    shutil.copy(pair.target if base == "target" else pair.plain, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def readers(pair, path, tmp_path):
    """compare (as target and as reference), inspect and `record --replay`: each one line, exit 2."""
    out = tmp_path / "replayed.h5"
    lines = [one_line_error(run_cli("compare", pair.ref, path)), one_line_error(run_cli("compare", path, pair.ref)),
             one_line_error(run_cli("inspect", path)),
             one_line_error(run_cli("record", "--replay", path, "-m", "resnet18", "-o", out))]
    assert not out.exists()
    return lines


def passwd_storage(f):
    del f["state_before/0.bias"]
    dset = f.create_dataset("state_before/0.bias", shape=(512,), dtype="u1", external=[("/etc/passwd", 0, 512)])
    dset.attrs["dtype"] = "uint8"


def test_etc_passwd_as_external_storage_is_refused_by_every_reader(pair, tmp_path):
    path = mutate(pair, tmp_path, passwd_storage)
    for line in readers(pair, path, tmp_path):
        assert line == (f"error: '{path}': '/state_before/0.bias' keeps its data in the external file "
                        f"'/etc/passwd': a recording stores every tensor inside itself")
    with pytest.raises(FormatError, match="external file '/etc/passwd'"):
        IterationFile(path)


def test_layer_replay_reads_through_the_same_door(pair, tmp_path):
    path = mutate(pair, tmp_path, passwd_storage)
    line = one_line_error(run_cli("replay", path, "--layer", "0"))
    assert "'/state_before/0.bias' keeps its data in the external file '/etc/passwd'" in line


def _external_link(f, other):
    del f["loss"]
    f["loss"] = h5py.ExternalLink(str(other), "loss")


def _dangling_soft_link(f, other):
    del f["loss"]
    f["loss"] = h5py.SoftLink("/nowhere")


def _soft_link_to_group(f, other):
    f["calls/0@0/forward/extra"] = h5py.SoftLink("/")


def _group_cycle(f, other):
    f["calls/0@0/forward/loop"] = f["calls"]  # a hard link to an ancestor: walking it would never end


def _virtual(f, other):
    layout = h5py.VirtualLayout(shape=(8,), dtype="f4")
    layout[...] = h5py.VirtualSource(str(other), "state_before/0.bias", shape=(8,))
    del f["state_before/0.bias"]
    f.create_virtual_dataset("state_before/0.bias", layout).attrs["dtype"] = "float32"


def _group_for_dataset(f, other):
    del f["calls/0@0/forward/output"]
    f.create_group("calls/0@0/forward/output")


def _string_for_tensor(f, other):
    del f["loss"]
    f.create_dataset("loss", data="1.0").attrs["dtype"] = "float32"


def _wrong_dtype(f, other):
    f["loss"].attrs["dtype"] = "bfloat16"  # float32 data claiming to be raw bfloat16 bits


def _plugin_filter(f, other):
    del f["state_before/0.bias"]
    f.create_dataset("state_before/0.bias", data=np.zeros(8, np.float32), chunks=(8,),
                     compression=32004, allow_unknown_filter=True).attrs["dtype"] = "float32"


# kind -> its edit of a copy of the target (`other`: a copy of the reference an edit may refer to)
_NEVER_IN_A_RECORDING = {
    "external_link": _external_link, "dangling_soft_link": _dangling_soft_link,
    "soft_link_to_group": _soft_link_to_group, "group_cycle": _group_cycle, "virtual": _virtual,
    "group_for_dataset": _group_for_dataset, "string_for_tensor": _string_for_tensor, "wrong_dtype": _wrong_dtype,
    "plugin_filter": _plugin_filter,
}


@pytest.mark.parametrize("kind", ["external_link", "dangling_soft_link", "soft_link_to_group", "group_cycle",
                                  "virtual", "group_for_dataset", "string_for_tensor", "wrong_dtype",
                                  "plugin_filter"])
def test_links_and_storage_a_recording_never_has_are_refused(pair, tmp_path, kind):
    other = tmp_path / "other.h5"
    shutil.copy(pair.ref, other)

    def edit(f):
        _NEVER_IN_A_RECORDING[kind](f, other)

    path = mutate(pair, tmp_path, edit)
    expected = {
        "external_link": f"'/loss' is an external link to '{other}' (path 'loss'): a recording never refers to "
                         f"other files",
        "dangling_soft_link": "'/loss' is a soft link to '/nowhere', which does not exist in the file",
        "soft_link_to_group": "'/calls/0@0/forward/extra' is a soft link to '/', a Group: a recording's links name "
                              "datasets only",
        "group_cycle": "'/calls/0@0/forward/loop' is a second link to a group already in the file (a cycle?): a "
                       "recording links only datasets",
        "virtual": "'/state_before/0.bias' is a virtual dataset (its data lives in other files): not in a recording",
        "group_for_dataset": "'/calls/0@0/forward/output' is a group, expected a dataset (tensor)",
        "string_for_tensor": "'/loss': expected a numeric tensor dataset, got HDF5 type object",
        "wrong_dtype": "'/loss': attribute 'dtype' says bfloat16, which is stored as uint16, but the data is float32",
        "plugin_filter": "'/state_before/0.bias' needs HDF5 filter 32004, not a built-in one: refused (a plugin "
                         "would run code)",
    }[kind]
    started = time.monotonic()
    for line in readers(pair, path, tmp_path):
        assert line == f"error: '{path}': {expected}"
    assert time.monotonic() - started < 60


def test_a_lazily_huge_dataset_is_refused_not_allocated(pair, tmp_path):
    def edit(f):
        del f["state_before/0.bias"]
        dset = f.create_dataset("state_before/0.bias", shape=(2**33,), dtype="f4", chunks=(2**16,))
        dset.attrs["dtype"] = "float32"

    path = mutate(pair, tmp_path, edit)
    assert path.stat().st_size < 200_000
    started = time.monotonic()
    line = one_line_error(run_cli("inspect", path))
    assert line == (f"error: '{path}': '/state_before/0.bias' has shape (8589934592,) (34359738368 bytes) but stores "
                    f"0 bytes: a sparse or truncated dataset")
    assert time.monotonic() - started < 10
    assert "but stores 0 bytes" in one_line_error(run_cli("compare", pair.ref, path))


@pytest.mark.parametrize("value, shown", [
    (None, None), (0, "0 (int)"), (-5, "-5 (int)"), (1.5, "1.5 (float)"), ("1", "'1' (str)"),
    (True, "True (bool)"), (np.array([3, 3]), "[3, 3] (list)"),
])
def test_schema_version_must_be_a_supported_integer(pair, tmp_path, value, shown):
    def edit(f):
        if value is None:
            del f.attrs["schema_version"]
        else:
            f.attrs["schema_version"] = value

    path = mutate(pair, tmp_path, edit)
    line = one_line_error(run_cli("inspect", path))
    if value is None:
        assert line == (f"error: '{path}': root attribute 'schema_version' is missing (expected an integer from 1 "
                        f"to 4)")
    else:
        assert line == (f"error: '{path}': root attribute 'schema_version': expected an integer from 1 to 4, got "
                        f"{shown}")
    assert one_line_error(run_cli("compare", pair.ref, path)) == line


def test_a_newer_schema_version_asks_for_an_upgrade(pair, tmp_path):
    path = mutate(pair, tmp_path, lambda f: f.attrs.__setitem__("schema_version", 5))
    assert one_line_error(run_cli("inspect", path)) == (
        f"error: '{path}' has schema version 5, this oneiter reads up to 4: upgrade oneiter")


@pytest.mark.parametrize("value, shown", [
    ("False", "'False' (str)"), ("True", "'True' (str)"), (float("nan"), "nan (float)"), (1, "1 (int)"),
])
def test_complete_must_be_the_boolean_true(pair, tmp_path, value, shown):
    path = mutate(pair, tmp_path, lambda f: f.attrs.__setitem__("complete", value))
    line = one_line_error(run_cli("compare", pair.ref, path))
    assert line == (f"error: '{path}': root attribute 'complete': expected the boolean True (a finished "
                    f"recording), got {shown}")
    assert one_line_error(run_cli("inspect", path)) == line


def test_a_missing_complete_is_an_incomplete_file(pair, tmp_path):
    path = mutate(pair, tmp_path, lambda f: f.attrs.__delitem__("complete"))
    assert one_line_error(run_cli("inspect", path)) == (
        f"error: '{path}' is incomplete: the run that wrote it did not finish")


@pytest.mark.parametrize("where, attr, value, message", [
    ("", "batch_size", 2.5, "root attribute 'batch_size': expected an integer, got 2.5 (float)"),
    ("", "batch_size", -3, "root attribute 'batch_size': expected an integer >= 0, got -3 (int)"),
    ("", "seed", "0", "root attribute 'seed': expected an integer, got '0' (str)"),
    ("", "model_args", "{not json",
     "root attribute 'model_args': expected a JSON object string, got '{not json' (str)"),
    ("", "level", "everything", "root attribute 'level': expected 'full' or 'stats', got 'everything' (str)"),
    ("", "model", 7, "root attribute 'model': expected a string, got 7 (int)"),
    ("calls/0@0", "exec_index", "first",
     "call group '0@0' attribute 'exec_index': expected an integer, got 'first' (str)"),
    ("calls/0@0", "call", -1, "call group '0@0' attribute 'call': expected an integer >= 0, got -1 (int)"),
    ("calls/0@0", "seq_output", 1.5, "call group '0@0' attribute 'seq_output': expected an integer, got 1.5 (float)"),
    ("calls/0@0", "module", 3, "call group '0@0' attribute 'module': expected a string, got 3 (int)"),
    ("state_before", "order", 5, "group '/state_before' attribute 'order': expected a list of strings, got 5 (int)"),
    ("loss", "dtype", 3, "dataset '/loss' attribute 'dtype': expected a torch dtype name (string), got 3 (int)"),
])
def test_attributes_a_reader_uses_are_type_checked(pair, tmp_path, where, attr, value, message):
    path = mutate(pair, tmp_path, lambda f: (f[where] if where else f).attrs.__setitem__(attr, value))
    assert one_line_error(run_cli("inspect", path)) == f"error: '{path}': {message}"


def test_a_fifo_is_refused_before_it_is_opened(pair, tmp_path):
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    results = {}

    def run():
        results["inspect"] = run_cli("inspect", fifo)
        results["compare"] = run_cli("compare", pair.ref, fifo)

    worker = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(30)
    if worker.is_alive():  # unblock a reader stuck in open() so the test run can go on, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("a reader blocked on the FIFO")
    assert time.monotonic() - started < 30
    for res in results.values():
        assert one_line_error(res) == (f"error: '{fifo}' is a FIFO (named pipe), expected a regular .h5 file "
                                       f"written by `oneiter record`")


def test_a_character_device_is_refused(pair):
    res = run_cli("inspect", "/dev/zero")
    assert one_line_error(res) == ("error: '/dev/zero' is a character device, expected a regular .h5 file written "
                                   "by `oneiter record`")


def test_slash_in_a_dict_key_or_module_name_is_refused_when_recording(tmp_path):
    import torch
    from torch import nn

    import oneiter

    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"x/y": self.lin(x)}

    class SlashDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.d = nn.ModuleDict({"a/b": nn.Linear(4, 4)})

        def forward(self, x):
            return {"y": self.d["a/b"](x)}

    expected = {
        DictOut: "cannot record 'calls/(root)@0/forward' entry 'output.x/y': it contains '/', which HDF5 reads as a "
                 "group separator; rename the ModuleDict or dict key",
        SlashDict: "cannot record 'state_before' entry 'd.a/b.weight': it contains '/', which HDF5 reads as a group "
                   "separator; rename the ModuleDict or dict key",
    }
    for cls, message in expected.items():
        model = cls()
        out = tmp_path / f"{cls.__name__}.h5"
        with pytest.raises(OneIterError) as info:
            with oneiter.Recorder(model, out) as rec:
                model(rec.inputs(torch.randn(2, 4)))["y" if cls is SlashDict else "x/y"].sum().backward()
        assert str(info.value) == message
        assert not out.exists()


def test_control_characters_and_markup_from_a_file_are_shown_escaped(pair, tmp_path):
    def edit(f):
        evil = "evil\x1b[31m[bold]x[red]\r"  # no '/': HDF5 would read it as a group separator
        f["calls/0@0/forward/output"][0, 0] += 1.0  # a divergence there: its name is in the report
        f.move("calls/0@0", f"calls/{evil}@0")  # the group's name and its module attribute agree
        f[f"calls/{evil}@0"].attrs["module"] = evil
        f.attrs["device"] = "cpu\x1b]0;title\x07"

    path = mutate(pair, tmp_path, edit, base="plain")
    res = run_cli("compare", pair.plain, path, "--all")
    assert res.exit_code == 1, res.output
    assert "\x1b" not in res.stdout and "\r" not in res.stdout and "\x07" not in res.stdout
    assert "evil\\x1b[31m[bold]x[red]\\x0d@0 forward output" in res.stdout
    assert "device cpu\\x1b]0;title\\x07" in res.stdout
    res = run_cli("inspect", path)
    assert res.exit_code == 0 and "\x1b" not in res.stdout
    assert "evil\\x1b[31m[bold]x[red]\\x0d@0" in res.stdout and "cpu\\x1b]0;title\\x07" in res.stdout


def test_safe_text_escapes_controls_and_keeps_the_rest():
    from oneiter.report.terminal import safe_text

    assert safe_text("a\x1b[31mb\tc\nd\x7f\x9b\u202e") == "a\\x1b[31mb\\x09c\\x0ad\\x7f\\x9b\\u202e"
    assert safe_text("layer1.0.conv1 [bold] é 名") == "layer1.0.conv1 [bold] é 名"
    assert safe_text("bad\udcff") == "bad\\udcff"
