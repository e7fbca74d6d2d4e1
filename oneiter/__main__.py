"""`python -m oneiter` (also what `torchrun -m oneiter` runs)."""

from .cli.main import main

main()
