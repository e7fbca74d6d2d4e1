"""`cli/`: the typer app, one module per command; each command parses options and calls the public API.

- `main.py`        the `oneiter` app: wires the commands (nothing here imports torch)
- `common.py`      consoles (results to stdout, messages to stderr), errors to one line and an exit code
- `help.py`        how the help reads: flags with no `<bool>` type, each command's summary on one line
- `option_aliases.py` option aliases shared by the commands, their flag names from `runtime/commands.py`
- `progress.py`    progress on stderr: a live line on a terminal, plain lines elsewhere
- `record_cmd.py`  `oneiter record`
- `record_params.py` its own options, and its parameters matched by name to the recording's settings (`SpecOptions`)
- `compare_cmd.py` `oneiter compare` (one iteration, multi-step recordings, ranks; `--drill`, `--suggest`)
- `replay_cmd.py`  `oneiter replay` (one layer run again; `--ops`)
- `inspect_cmd.py` `oneiter inspect`
- `profile_cmd.py` `oneiter profile` and `profile diff`
- `models_cmd.py`  `oneiter models`
- `demo_cmd.py`    `oneiter demo`
"""
