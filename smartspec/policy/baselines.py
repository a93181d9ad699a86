"""Baseline policies that share all the engine's machinery: never speculate, a fixed k, and k looked up by batch
size (the static scheme other servers use)."""
from __future__ import annotations

from smartspec.policy.base import Policy


class OffPolicy(Policy):
    """Never speculate: the draft never runs."""
    name = "off"

    def choose_ks(self, view):
        return [0] * len(view.requests)


class FixedPolicy(Policy):
    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def choose_ks(self, view):
        return [min(self.k, view.k_max)] * len(view.requests)


class BatchTablePolicy(Policy):
    """k by batch size from a table {batch size: k}: the static scheme other servers use. A batch uses the
    entry of the largest size not above it."""
    name = "batch_table"

    def __init__(self, table: dict[int, int]) -> None:
        if not table or any(int(b) < 1 or int(k) < 0 for b, k in table.items()):
            raise ValueError(f"batch_table needs {{batch size >= 1: k >= 0}}, got {table!r}")
        self.table = sorted((int(b), int(k)) for b, k in table.items())

    def k_for(self, batch: int) -> int:
        k = 0
        for size, value in self.table:
            if size <= batch:
                k = value
        return k

    def choose_ks(self, view):
        return [min(self.k_for(len(view.requests)), view.k_max)] * len(view.requests)


def default_batch_table(k_max: int) -> dict[int, int]:
    return {1: k_max, 2: max(1, k_max - 1), 4: max(1, k_max // 2), 8: 1, 16: 0}
