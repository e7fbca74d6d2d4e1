"""`judge/iteration/`: two recordings of one iteration compared.

Imports go one way: `entries` -> `findings`, `recipe_costs` -> `summed` -> `blame`, `pairing`, `impact` -> `sentences`
-> `statement` -> `verdict` -> `results` -> `engine` -> `ranks`, `suggest`. The result types have modules of their
own (`entries.py`, `statement.py`, `results.py`), so the engine, blame and the verdict read them without reading one
another (the verdict reads a result as its `Evidence`).

- `entries.py`  an entry of both files compared (`Row`), a call's own error (`LocalResult`), their `Key`, the statuses
- `findings.py` what blame found, and the one table of priorities the verdict picks among them by
- `pairing.py`  which entries pair up, in causal order, and which a compiled block hides; which files may be compared
- `blame.py`    local (per-call) error against expected noise: the culprit; the NaN/Inf origin
- `summed.py`   a gradient summed from its readers' gradients: which they are, and the drift it inherits
- `recipe_costs.py` what the target's low-precision recipes cost per call, and how closely it follows them
- `impact.py`   which fix matters: the flagged calls ranked by the share of the gap fixing each closes
- `sentences.py` the sentences a verdict is stated in, each from plain values (entry names, reasons, numbers, lines)
- `statement.py` what a verdict states: `Verdict`, `Culprit`, their JSON form, headline and details (`render`)
- `verdict.py`  the verdict, decided once (status, basis, culprit, first divergence, counts; row statuses settled)
- `results.py`  `CompareResult`: rows, findings, notes and the verdict decided from them; its JSON form
- `engine.py`   `compare_files` / `compare_local`: pair entries, measure rows, blame, decide
- `ranks.py`    torchrun recordings compared rank by rank, in parallel processes (or a torchrun job's)
- `collective_verdict.py` every rank's collectives against the exact reduction of its group's recorded inputs
- `transfers.py` every point-to-point transfer: what the receiving rank got against what the sending rank sent
- `suggest.py`  `compare --suggest`: from a `--level stats` screening to the region to record in full
"""
