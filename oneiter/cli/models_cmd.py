"""`oneiter models`: list the built-in models."""

from __future__ import annotations

import typer

from oneiter.cli.common import handle_errors, out

HELP = """List the built-in models. Your own: --model path/to/file.py:function (see the README's model contract).

[b]Example[/b]

  oneiter models
"""


def models_command() -> None:
    from oneiter.models import list_models

    for name, description in list_models():
        out.print(f"{name:<14} {description}")


def register(app: typer.Typer) -> None:
    app.command("models", help=HELP)(handle_errors(models_command))
