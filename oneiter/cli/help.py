"""How the CLI's help reads: as typer CLIs' help does, whatever typer's version renders by default.

- A flag (`--force`, `--version`, `--isolate/--no-isolate`, `--help`) takes no value, so its row shows no type:
  typer 0.2x prints `<bool>` beside every flag in the rich help, which reads as if it wanted one.
- A command's summary in `oneiter --help` is its help's first paragraph on one line: in rich markup mode typer keeps
  the hard line breaks of the help text there, which broke the summaries mid-sentence.

`main.py` builds the groups with `HelpGroup` and calls `readable(app)` once every command is registered: each
command gets `HelpCommand` (or its own subclass of it: `options.CompileCommand`) and `summary(its help)` as the
summary, so a command added later reads the same without a line of its own. Torch-free (`oneiter --help` imports it).
"""

from __future__ import annotations

import typer
from typer.core import TyperCommand, TyperGroup

__all__ = ["HelpCommand", "HelpGroup", "summary", "readable"]


def _untyped_flags(params: list) -> list:
    """`params` with every flag's type column left empty (its metavar: what typer shows there when set)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class HelpCommand(TyperCommand):
    """A command whose flags show no `<bool>` in its help."""

    def get_params(self, ctx) -> list:
        return _untyped_flags(super().get_params(ctx))


class HelpGroup(TyperGroup):
    """A group (the `oneiter` app, `oneiter profile`) whose flags show no `<bool>` in its help."""

    def get_params(self, ctx) -> list:
        return _untyped_flags(super().get_params(ctx))


def summary(help_text: str) -> str:
    """A help text's first paragraph on one line: what `oneiter --help` lists beside the command."""
    return " ".join(help_text.strip().split("\n\n")[0].split())


def readable(app: typer.Typer) -> None:
    """Every command registered on `app` (and on the groups added to it) built as a `HelpCommand`, its summary in
    `oneiter --help` its help's first paragraph on one line."""
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):  # typer's default; a command's own class subclasses HelpCommand
            command.cls = HelpCommand
        command.short_help = command.short_help or summary(command.help or "")
    for group in app.registered_groups:
        sub = group.typer_instance
        assert sub is not None  # `add_typer` registers a group with its Typer
        group.short_help = group.short_help or summary(group.help or sub.info.help or "")
        readable(sub)
