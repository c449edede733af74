"""Repeated measurements in one cell of a table: the median with the range, "median [min-max]"."""

from __future__ import annotations

import statistics
from typing import Sequence


def median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def median_range(values: Sequence[float], spec: str = ".1f", range_spec: str | None = None, suffix: str = "",
                 brackets: str = "[]") -> str:
    """'median [min-max]': the median formatted with `spec` and `suffix`, the range with `range_spec` (default
    `spec`) inside `brackets`; '-' when there are no values."""
    if not values:
        return "-"
    median, low, high = median_min_max(values)
    range_spec = spec if range_spec is None else range_spec
    return f"{median:{spec}}{suffix} {brackets[0]}{low:{range_spec}}-{high:{range_spec}}{brackets[1]}"
