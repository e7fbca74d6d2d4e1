"""The CLI's help reads as typer CLIs' help does: a flag's row shows no `<bool>` type (it takes no value), and each
command's summary in `oneiter --help` is its help's first paragraph on one line, not broken where the help text's
source lines end."""

from __future__ import annotations

import click
import pytest
import typer
import typer.rich_utils
from typer.testing import CliRunner

from oneiter.cli import profile_cmd, record_cmd
from oneiter.cli.help import summary
from oneiter.cli.main import app


def _command_paths(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The words that reach every command and group of the app (`()` is `oneiter` itself)."""
    found = [path]
    for name, sub in getattr(command, "commands", {}).items():
        found += _command_paths(sub, path + (name,))
    return found


COMMANDS = _command_paths(typer.main.get_command(app))


@pytest.fixture
def wide(monkeypatch):
    """Help rendered 400 columns wide: a line break in a summary is then the text's own, not the terminal's."""
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 400)


def _help(*words: str) -> str:
    result = CliRunner().invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_and_group_is_reached():
    assert {(), ("record",), ("compare",), ("inspect",), ("replay",), ("models",), ("demo",), ("profile",),
            ("profile", "diff")} == set(COMMANDS)


@pytest.mark.parametrize("words", COMMANDS, ids=lambda words: " ".join(("oneiter", *words)))
def test_no_flag_shows_a_bool_type(words, wide):
    text = _help(*words)
    assert "<bool>" not in text
    assert "--help" in text and "Show this message and exit." in text


def test_options_that_take_a_value_keep_their_type(wide):
    rows = {line.split()[1]: line for line in _help("record").splitlines() if line.startswith("│")
            and len(line.split()) > 1}
    assert "<path>" in rows["*"] and "--out" in rows["*"]  # the required --out: `│ *  --out -o <path> ...`
    assert "<int>" in rows["--steps"] and "<list[str]>" in rows["--include"]
    assert "--no-isolate" in rows["--isolate"] and "<" not in rows["--isolate"].split("With --replay")[0]
    assert "--version" in _help() and "<bool>" not in _help()


def test_each_commands_summary_is_one_line_of_the_apps_help(wide):
    lines = _help().splitlines()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        expected = summary(command.help)
        assert " ".join(expected.split()) == expected and "\n" not in expected
        assert any(expected in line for line in lines), f"{name}'s summary is not one line of `oneiter --help`"
    # the two whose help text wraps its first paragraph over several source lines
    assert "\n" in record_cmd.HELP.split("\n\n")[0] and "\n" in profile_cmd.HELP.split("\n\n")[0]
    assert any("or iteration S of a run in full (--step S)." in line for line in lines)
    assert any("op / memory / per-module tables and summary.json" in line for line in lines)


def test_the_summary_is_the_first_paragraph_joined():
    assert summary("Record one\niteration  of a run.\n\n[b]Examples[/b]\n\n  oneiter record") == \
        "Record one iteration of a run."


def test_square_brackets_in_option_help_are_printed(wide):
    """rich markup would read `[float8]` as a tag and print `'oneiter'`."""
    assert "'oneiter[float8]'" in _help("record")
