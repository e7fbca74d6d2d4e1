"""`judge/steps/`: two multi-step recordings compared step by step.

- `step_compare.py` the error of every step against the band the twin measured; the first step outside it
"""
