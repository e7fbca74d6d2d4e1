"""A recording's settings are declared once, in `RecordOptions` (and `SpecOptions`, which adds how a model spec is
built): `oneiter record` has an option for every field, or the field is in `record_params.API_ONLY` with its reason;
and it has no option that maps to no field (`record_params.CLI_ONLY` aside). Each option's default is its field's,
and a command line reaches the fields converted."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import click
import typer

from oneiter.cli import record_params as rec
from oneiter.cli.main import app
from oneiter.cli.record_cmd import record_command
from oneiter.record.options import RecordOptions
from oneiter.record.run import SpecOptions

PARAMS = inspect.signature(record_command).parameters
FIELDS = {f.name: f for f in dataclasses.fields(SpecOptions)}


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def test_every_recording_setting_has_a_record_option_or_a_reason():
    from_cli = {rec.RENAMED.get(name, name) for name in PARAMS if name not in rec.CLI_ONLY}
    missing = sorted(set(FIELDS) - from_cli - set(rec.API_ONLY))
    assert not missing, f"RecordOptions/SpecOptions fields with no `record` option and no reason in API_ONLY: {missing}"
    assert not from_cli & set(rec.API_ONLY), "a field both has an option and is listed as API-only"
    assert {f.name for f in dataclasses.fields(RecordOptions)} <= from_cli | set(rec.API_ONLY)
    assert all(len(reason.split()) >= 5 for reason in rec.API_ONLY.values())


def test_no_record_option_maps_to_nothing():
    unmapped = sorted(name for name in PARAMS if rec.RENAMED.get(name, name) not in FIELDS and name not in rec.CLI_ONLY)
    assert not unmapped, f"`record` options that set no SpecOptions field: {unmapped}"
    assert set(rec.API_ONLY) <= set(FIELDS) and set(rec.RENAMED) <= set(PARAMS) and set(rec.CONVERT) <= set(PARAMS)
    assert not set(rec.CLI_ONLY) & set(FIELDS)


def test_each_option_defaults_to_its_fields_default():
    for name, param in PARAMS.items():
        if name in rec.CLI_ONLY:
            continue
        field = FIELDS[rec.RENAMED.get(name, name)]
        if param.default is inspect.Parameter.empty:  # required on the CLI: required in the dataclass
            assert _field_default(field) is dataclasses.MISSING, name
            continue
        assert rec.spec_fields({name: param.default}) == {field.name: _field_default(field)}, name


def test_a_command_line_reaches_the_fields_converted(tmp_path: Path):
    words = ["--model", "resnet18", "-o", str(tmp_path / "a.h5"), "--inject-fault", "layer1.0.conv1",
             "--inject-fault", "fc", "--fallback", "convolution, addmm", "--model-arg", "image_size=32",
             "--include", "layer1", "--no-isolate", "--calibrate", "device", "--level", "stats", "--quiet",
             "--seed", "3", "--threads", "2", "--exclude", "fc"]
    group = typer.main.get_command(app)
    with click.Context(group) as root:
        params = group.get_command(root, "record").make_context("record", words, parent=root).params
    options = SpecOptions(**rec.spec_fields(params))
    assert (options.model, options.out, options.seed, options.threads) == ("resnet18", tmp_path / "a.h5", 3, 2)
    assert options.faults == ["layer1.0.conv1", "fc"] and options.fallback == ["convolution", "addmm"]
    assert options.model_args == {"image_size": 32} and options.include == ["layer1"] and options.exclude == ["fc"]
    assert (options.isolate, options.calibrate, options.level, options.compile_modules) == (
        False, "device", "stats", [])
