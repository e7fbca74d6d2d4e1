"""The command lines oneiter prints for a user to run (`runtime/commands.py`) are commands the CLI takes: every
flag in them is parsed by the command it names, into the values it was built from."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click
import pytest
import typer

from oneiter.cli.main import app
from oneiter.runtime import commands

# a reference's and a target's first-step metadata with every field a command is built from
REFERENCE = {"model": "resnet18", "model_args": json.dumps({"image_size": 32, "num_classes": 10}), "batch_size": 2,
             "rng_seed": 3, "optimizer": "adamw", "device": "cpu", "num_threads": 2}
TARGET = {**REFERENCE, "device": "cuda:1", "dtype": "bfloat16", "amp": "bf16",
          "faults": json.dumps(["layer3.1.conv2"]), "fallback": json.dumps(["convolution", "addmm"])}


def parse(line: str) -> tuple[str, dict]:
    """The subcommand a printed line runs and the parameters the CLI parses from it (an unknown flag raises)."""
    words = shlex.split(line)
    assert words[0] == "oneiter"
    group = typer.main.get_command(app)
    with click.Context(group) as root:
        command = group.get_command(root, words[1])
        context = command.make_context(words[1], words[2:], parent=root)
    return words[1], context.params


def test_the_step_commands_parse_into_what_they_were_built_from(tmp_path: Path):
    first, then = commands.record_step_commands(REFERENCE, TARGET, tmp_path / "ref.h5", tmp_path / "tgt.h5", 6)
    name, ref = parse(first)
    assert name == "record"
    assert (ref["model"], ref["step"], ref["batch_size"], ref["seed"], ref["optimizer"], ref["device"],
            ref["threads"]) == ("resnet18", 6, 2, 3, "adamw", "cpu", 2)
    assert sorted(ref["model_arg"]) == ["image_size=32", "num_classes=10"] and ref["out"] == tmp_path / "ref.step6.h5"
    name, tgt = parse(then)
    assert name == "record" and tgt["replay"] == tmp_path / "ref.step6.h5" and tgt["out"] == tmp_path / "tgt.step6.h5"
    assert (tgt["device"], tgt["dtype"], tgt["amp"], tgt["inject_fault"], tgt["fallback"]) == (
        "cuda:1", "bfloat16", "bf16", ["layer3.1.conv2"], "convolution,addmm")


def test_a_printed_command_writes_a_flag_by_its_alias_else_by_its_name(tmp_path: Path):
    assert (commands.OUT.brief, commands.STEP.brief) == ("-o", "--step")
    first, then = commands.record_step_commands(REFERENCE, TARGET, tmp_path / "ref.h5", tmp_path / "tgt.h5", 6)
    assert shlex.split(first)[-2:] == ["-o", str(tmp_path / "ref.step6.h5")]
    assert shlex.split(then)[-2:] == ["-o", str(tmp_path / "tgt.step6.h5")]


def test_a_recording_that_names_no_model_spec_gets_no_command(tmp_path: Path):
    assert commands.record_step_commands({**REFERENCE, "model": "MyNet"}, TARGET, tmp_path / "a.h5",
                                         tmp_path / "b.h5", 6) is None


@pytest.mark.parametrize("model", [None, "my_model.py:build"])
def test_the_drill_command_parses_into_what_it_was_built_from(model):
    line = commands.replay_ops_command("ref.h5", "layer1.0.conv1", 2, device="npu:0", dtype="bfloat16", amp=None,
                                       model=model)
    name, params = parse(line)
    assert name == "replay" and (params["file"], params["layer"], params["call"], params["ops"]) == (
        Path("ref.h5"), "layer1.0.conv1", 2, True)
    assert (params["device"], params["dtype"], params["amp"], params["model"]) == ("npu:0", "bfloat16", "none", model)


def test_the_drill_command_of_a_compiled_block_names_its_backend():
    line = commands.replay_ops_command("ref.h5", "shared", 0, device="cpu", dtype=None, amp=None,
                                       model="my_model.py:build", compile="wrong_gelu")
    name, params = parse(line)
    assert name == "replay" and (params["layer"], params["compile"], params["model"]) == (
        "shared", "wrong_gelu", "my_model.py:build")


def test_the_flags_are_the_cli_s():
    """Every flag of the table is declared by the CLI under that name (renaming one there renames it here)."""
    declared = set()
    for _, option in _options(typer.main.get_command(app)):  # every command's, subcommands' and the app's own
        declared.update(option.opts)
        if option.secondary_opts:  # an on/off option: its Flag declares `--isolate/--no-isolate`
            declared.add(f"{option.opts[0]}/{option.secondary_opts[0]}")
    flags = [value for value in vars(commands).values() if isinstance(value, commands.Flag)]
    assert len(flags) >= 18
    assert not [f for f in flags if not set(f.decls) <= declared]


def _options(command):
    """(command path, option) for every option of every command and group of the app, typer's `--help` aside."""
    stack = [("oneiter", command)]
    while stack:
        path, cmd = stack.pop()
        yield from ((path, p) for p in cmd.params if isinstance(p, typer.core.TyperOption) and p.name != "help")
        stack += [(f"{path} {name}", sub) for name, sub in getattr(cmd, "commands", {}).items()]


def test_every_option_takes_its_names_from_the_one_table():
    """The CLI's flag names are declared once, in `runtime/commands.py`: an option whose names are not one `Flag`'s
    fails, and so does a `Flag` no command declares (renaming a flag there renames it everywhere)."""
    table = {name: flag for name, flag in vars(commands).items() if isinstance(flag, commands.Flag)}
    names = {frozenset(n for n in flag if n): name for name, flag in table.items()}
    used, inline = set(), []
    for path, option in _options(typer.main.get_command(app)):
        found = names.get(frozenset([*option.opts, *option.secondary_opts]))
        if found is None:
            inline.append(f"{path} {'/'.join(option.opts)}")
        used.add(found)
    assert not inline, f"options declared with names of their own, not a Flag of runtime/commands.py: {inline}"
    assert not set(table) - used, f"Flags no command declares: {sorted(set(table) - used)}"
    assert len(names) == len(table), "two Flags with the same names"
    assert commands.ISOLATE.decls == ("--isolate/--no-isolate",) and commands.QUIET.decls == ("--quiet", "-q")
