"""`record/impact/`: which flagged call matters — the iteration run again with each one fixed (`record --impact`).

- `candidates.py`  which calls are fixed one at a time: every flagged call, largest own error first
- `start.py`       where every run starts: a copy of the iteration's start, swapped in and out
- `float64.py`     a fixed call's float64 recomputation on the trusted path, and its live children, as autograd nodes
- `fixed_call.py`  the calls fixed in one run: which call of a module this is, what its live forward called
- `gaps.py`        how far one run lands from the reference: loss, parameter gradients, updated weights
- `impact_pass.py` one run of the iteration from its start: the reference's batch and random values, the gaps
- `runs.py`        the runs of `record --impact` (nothing fixed, each call fixed, all fixed) and the `/impact` rows
- `recorded.py`    those runs at the end of a Recorder's block, over the iteration it recorded, into its file
"""
