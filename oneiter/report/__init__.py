"""`report/`: one comparison result shown to people and programs.

- `terminal.py`    the terminal report, JSON and CSV
- `html.py`        the self-contained HTML page
- `tensorboard.py` TensorBoard curves and histograms
"""
