"""`report/`: one comparison result shown to people and programs.

- `terminal.py`    the terminal report, JSON and CSV
- `ranks.py`       the terminal report of a multi-rank comparison
- `html.py`        the self-contained HTML page
- `tensorboard.py` TensorBoard curves and histograms
"""
