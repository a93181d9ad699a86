"""What counts as an integer or a number in a configuration or a request: bool is neither (Python's bool is an int,
and `True` where a count belongs is a mistake to name, not 1)."""
from __future__ import annotations

import math


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or a finite float."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
