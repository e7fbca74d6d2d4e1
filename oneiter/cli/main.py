"""The `oneiter` command: wires one module per command. Nothing here imports torch (`oneiter --help` is fast)."""

from __future__ import annotations

import typer

from oneiter.cli import compare_cmd, demo_cmd, inspect_cmd, models_cmd, profile_cmd, record_cmd, replay_cmd
from oneiter.cli.help import HelpGroup, readable
from oneiter.runtime import commands as flags

app = typer.Typer(
    name="oneiter",
    help="Find which layer makes a model's training numbers differ between a reference device and a target.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=HelpGroup,
)

def _version(value: bool) -> None:
    if value:
        from oneiter import __version__

        typer.echo(f"oneiter {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, *flags.VERSION.decls, callback=_version, is_eager=True, help=
            "Print the version and exit."),
) -> None:
    """Find which layer makes a model's training numbers differ between a reference device and a target."""


for module in (record_cmd, compare_cmd, inspect_cmd, replay_cmd, models_cmd, demo_cmd):
    module.register(app)
app.add_typer(profile_cmd.app, name="profile")
readable(app)  # flags without `<bool>`, each summary on one line (`help.py`)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
