"""`python -m oneiter` (also what `torchrun -m oneiter` runs)."""

from oneiter.cli.main import main

main()
