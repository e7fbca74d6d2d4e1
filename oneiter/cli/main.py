"""The `oneiter` command: wires one module per command. Nothing here imports torch (`oneiter --help` is fast)."""

from __future__ import annotations

import typer

from . import compare_cmd, demo_cmd, inspect_cmd, models_cmd, profile_cmd, record_cmd, replay_cmd

app = typer.Typer(
    name="oneiter",
    help="Find which layer makes a model's training numbers differ between a reference device and a target.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

for module in (record_cmd, compare_cmd, inspect_cmd, replay_cmd, models_cmd, demo_cmd):
    module.register(app)
app.add_typer(profile_cmd.app, name="profile")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
