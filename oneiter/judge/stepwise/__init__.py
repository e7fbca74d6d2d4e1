"""`judge/stepwise/`: two multi-step recordings compared step by step.

Imports go one way: `band` -> `step_verdict` -> `step_compare`.

- `band.py`         each step's error against the band the twin measured (or the tolerance, without a twin)
- `step_verdict.py` the verdict: the first step outside the band, as findings (`judge/iteration/findings.py`)
- `step_compare.py` `compare_steps`: the two files checked, measured and judged; `StepsResult`
"""
