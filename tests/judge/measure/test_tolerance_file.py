"""Tolerance files are validated key by key: a misspelled key or a wrong type is an error naming it, never ignored."""

from __future__ import annotations

import pytest
from conftest import run_cli

from oneiter.errors import OneIterError
from oneiter.judge.measure.tolerance_file import load_tolerance_file

GOOD = """device = "npu"
[noise]
factor = 8.0
[dtype.bfloat16]
rtol = 2e-2
[[module]]
pattern = "layer4.*"
factor = 16.0
[skip]
modules = ["*.dropout"]
"""


def test_a_valid_file_is_read(tmp_path):
    path = tmp_path / "npu.toml"
    path.write_text(GOOD)
    spec = load_tolerance_file(path)
    assert (spec.device, spec.dtypes, spec.skip) == ("npu", {"bfloat16": {"rtol": 0.02}}, ["*.dropout"])
    assert spec.modules == [{"pattern": "layer4.*", "factor": 16.0}] and spec.noise.factor == 8.0


@pytest.mark.parametrize("mistake, message", [
    (GOOD.replace("factor = 8.0", "facter = 8.0"), "t.toml noise: unknown key(s) facter; expected factor, floor_ulps"),
    (GOOD.replace("rtol = 2e-2", "rtl = 2e-2"), "t.toml dtype.bfloat16: unknown key(s) rtl; expected atol, rtol"),
    (GOOD.replace("[dtype.bfloat16]", "[dtype.bf16]"), "t.toml: unknown dtype 'bf16'; expected one of float64"),
    (GOOD.replace('pattern = "layer4.*"', 'patern = "layer4.*"'),
     "t.toml module entry 0: unknown key(s) patern; expected pattern, atol, rtol, factor"),
    (GOOD.replace("modules = [", "module = ["), "t.toml skip: unknown key(s) module; expected modules"),
    (GOOD.replace('device = "npu"', "device = 3"), 't.toml device: expected a device type such as "npu", got 3'),
    (GOOD.replace('modules = ["*.dropout"]', 'modules = "*.dropout"'),
     "t.toml skip.modules: expected a list of module globs, got '*.dropout'"),
    ("noise = 4\n", "t.toml noise: expected a table, got int 4"),
    ("[nosie]\nfactor = 4\n", "t.toml: unknown key(s) nosie"),
])
def test_mistakes_are_named(tmp_path, mistake, message):
    path = tmp_path / "t.toml"
    path.write_text(mistake)
    with pytest.raises(OneIterError) as err:
        load_tolerance_file(path)
    assert str(err.value).startswith(message)


def test_the_cli_refuses_a_misspelled_tolerance_file_with_exit_2(tmp_path, resnet_ref):
    path = tmp_path / "t.toml"
    path.write_text(GOOD.replace("factor = 8.0", "facter = 8.0"))
    res = run_cli("compare", resnet_ref, resnet_ref, "--tolerances", path)
    assert res.exit_code == 2 and res.stderr.startswith("error: t.toml noise: unknown key(s) facter")
