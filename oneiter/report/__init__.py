"""`report/`: one comparison result shown to people and programs.

- `terminal.py`    the terminal report, JSON and CSV; the verdict block and the plain table every report prints
- `rank_table.py`  the terminal report of a multi-rank comparison
- `html.py`        the self-contained HTML page; the verdict banner every page shows
- `tensorboard.py` TensorBoard curves and histograms
- `multistep.py`   two multi-step recordings compared: the per-step table, CSV and page with the curves and the band
- `op_table.py`    the aten ops of one call (`replay --ops`, `compare --drill`): terminal table and HTML section
- `impact_table.py` which fix matters (`record --impact`): the ranking's cells, its HTML section, its CSV columns
"""
