"""`oneiter profile`'s settings are declared once, in `ProfileOptions`: the command has an option for every field and
no option that maps to no field (`profile_cmd.CLI_ONLY` aside), each default its field's, and a command line reaches
the fields by name."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import click
import typer

from oneiter.cli import profile_cmd
from oneiter.cli.main import app
from oneiter.profile.runner import ProfileOptions

PARAMS = inspect.signature(profile_cmd.profile_command).parameters
FIELDS = {f.name: f for f in dataclasses.fields(ProfileOptions)}


def test_every_profile_setting_has_an_option_and_every_option_a_setting():
    from_cli = {profile_cmd.RENAMED.get(name, name) for name in PARAMS if name not in profile_cmd.CLI_ONLY}
    assert from_cli == set(FIELDS), (sorted(set(FIELDS) - from_cli), sorted(from_cli - set(FIELDS)))
    assert set(profile_cmd.RENAMED) <= set(PARAMS) and set(profile_cmd.CLI_ONLY) <= set(PARAMS)


def test_each_option_defaults_to_its_fields_default():
    for name, param in PARAMS.items():
        if name in profile_cmd.CLI_ONLY or name == "model":  # model: the CLI's None means resnet18 (DEFAULT_MODEL)
            continue
        field = FIELDS[profile_cmd.RENAMED.get(name, name)]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        (value,) = profile_cmd.profile_fields({name: param.default}).values()
        if name == "out_dir":  # the CLI's Path("prof"), the field's "prof"
            value, default = Path(value), Path(default)
        assert value == default, name
    assert FIELDS["model"].default is dataclasses.MISSING and PARAMS["model"].default is None


def test_a_command_line_reaches_the_fields():
    words = ["-m", "llama_tiny", "--model-arg", "layers=1", "--no-overhead", "-s", "active=1", "--with-stack",
             "--limit", "3", "-o", "p"]
    group = typer.main.get_command(app)
    with click.Context(group) as root:
        profile = group.get_command(root, "profile")
        params = profile.make_context("profile", words, parent=root).params
    options = ProfileOptions(**profile_cmd.profile_fields({"ctx": None, **params}))
    assert (options.model, options.model_args, options.measure_overhead, options.schedule) == (
        "llama_tiny", {"layers": 1}, False, "active=1")
    assert (options.with_stack, options.out_dir, options.batch_size) == (True, Path("p"), 8)
