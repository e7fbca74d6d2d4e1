"""`cli/`: the typer app, one module per command; each command parses options and calls the public API."""
