"""Checking the draft's price while the policy does not draft. At k = 0 no step measures the draft, so a price set
too high (a warm-up profile taken while the draft actor was busy, or under a load since gone) would hold a replica
at k = 0 for good. Now and then such a step drafts one token for one request: its draft time checks the price.
A check that agrees puts the next one off `longest` steps (on a CPU a check's catch-up costs several steps, and
checks every few hundred steps cost a loaded replica 1-3%); one that does not, or any drafting step that does
not, brings the checks back to every `first` steps. Drafting steps check the price as they run, so
a policy that drafts is never made to check."""
from __future__ import annotations


class DraftPriceCheck:
    def __init__(self, first: int = 64, longest: int = 1024, tolerance: float = 1.5) -> None:
        if not (isinstance(first, int) and 1 <= first <= longest and tolerance > 1):
            raise ValueError(f"DraftPriceCheck needs 1 <= first <= longest and tolerance > 1: got {first!r}, "
                             f"{longest!r}, {tolerance!r}")
        self.first, self.longest, self.tolerance = first, longest, tolerance
        self.interval = first
        self.due_at = first
        self.checks = 0  # steps run to check the price

    def is_due(self, step: int) -> bool:
        return step >= self.due_at

    def ran(self, step: int) -> None:
        """A check was planned at `step`: none again before its outcome is in and judged."""
        self.checks += 1
        self.due_at = step + self.interval

    def measured(self, step: int, ratio: float) -> bool:
        """A drafting step's draft time over its predicted time; whether the price agrees with it."""
        agrees = 1.0 / self.tolerance <= ratio <= self.tolerance
        self.interval = self.longest if agrees else self.first
        self.due_at = step + self.interval
        return agrees
