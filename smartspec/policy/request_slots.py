"""Per request, a row of numbers in one array: what the policy keeps per request, read and written for a whole batch
in a few array operations instead of a Python step per request (vLLM's input-batch pattern, for the policy's own
state). A request's row is taken when it first needs one and given back when it leaves; row 0 stays all zeros and
stands for every request without a row, so a batch's rows are read in one gather whoever is new."""
from __future__ import annotations

from itertools import repeat

import numpy as np


class RequestSlots:
    def __init__(self, columns: int, capacity: int = 64) -> None:
        if not (isinstance(columns, int) and columns >= 1 and isinstance(capacity, int) and capacity >= 1):
            raise ValueError(f"columns and capacity must be integers >= 1, got {columns!r}, {capacity!r}")
        self.values = np.zeros((capacity + 1, columns))  # row 0: the zeros of a request without a row
        self._row: dict[str, int] = {}
        self._free = list(range(capacity, 0, -1))  # popped from the end: low rows first

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

    def rows_of(self, request_ids) -> np.ndarray:
        """Each request's row, 0 (zeros) for one without."""
        return np.array(list(map(self._row.get, request_ids, repeat(0))), dtype=np.int64)

    def rows_for(self, request_ids) -> np.ndarray:
        """Each request's row, taken for those without one (zeros to start from). Ids are distinct."""
        row = self._row
        missing = [rid for rid in request_ids if rid not in row]
        if missing:
            if len(missing) > len(self._free):
                self._grow(len(missing) - len(self._free))
            for rid in missing:
                row[rid] = self._free.pop()
        return np.array(list(map(row.__getitem__, request_ids)), dtype=np.int64)

    def pop(self, request_id: str) -> np.ndarray | None:
        """The request's numbers, its row given back (None: it had none)."""
        i = self._row.pop(request_id, None)
        if i is None:
            return None
        values = self.values[i].copy()
        self.values[i] = 0.0
        self._free.append(i)
        return values

    def _grow(self, at_least: int) -> None:
        old = len(self.values) - 1
        new = max(2 * old, old + at_least)
        self.values = np.concatenate([self.values, np.zeros((new - old, self.values.shape[1]))])
        self._free[:0] = range(new, old, -1)  # below the rows already free, so those are taken first
