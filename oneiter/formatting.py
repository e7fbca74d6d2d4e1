"""How oneiter writes a number, reads one back from its JSON, and compares two: one place for every report.

A leaf (pure Python, torch- and numpy-free), so every layer that shows or judges numbers imports it: the verdict's
sentences (`judge/iteration/verdict.py`), the multi-step rows (`judge/stepwise/band.py`), every report (`report/`) and
the CLI's tables. A table's layout (columns, a plain terminal table) is `report/terminal.py`'s.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["sci", "num", "json_ready", "rel_diff"]


def num(value: Any) -> Optional[float]:
    """A number of the verdict or a JSON document as float: "inf"/"nan" strings (JSON has none) back to floats;
    None for what is no number (None, a bool, text)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def json_ready(value: Any) -> Any:
    """JSON has no inf/nan: they become the strings "inf", "-inf", "nan" (`num` reads them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def sci(value: Any, width: int = 0, *, digits: int = 2, nan: Optional[str] = None) -> str:
    """`1.23e-04`: scientific notation with `digits` decimals, right-aligned in `width` characters; "-"
    where there is no number (`num`: None, text); NaN as `nan` when given (a table of metrics gives "-": a
    statistics-level entry has no elementwise numbers to show), else as Python writes it."""
    v = num(value)
    if v is None:
        return "-"
    if nan is not None and v != v:
        return nan
    return f"{v:{width}.{digits}e}"


def rel_diff(a: float, b: float) -> float:
    """The symmetric relative difference |a - b| / max(|a|, |b|): 0 when equal, NaN when it has no scale (both 0
    but not equal, or one infinite)."""
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale and math.isfinite(scale) else math.nan
