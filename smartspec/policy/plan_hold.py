"""How often a batch is planned in full.

A full plan (estimates, catch-ups, every depth, probes) costs the host from a fraction of a millisecond at one
request to a millisecond or more at hundreds, which on a GPU is a sizeable share of a step, and in steady decoding it
keeps coming out the same: the same draft lengths for the same requests, or no speculation for a loaded batch. So a
plan that comes out as the last one did is held for twice as many steps as the last (1, 2, 4, up to `max_hold`), the
steps in between running it again; one that comes out differently, or probes, plans every step again. No
speculation is held whatever requests come and go (a request that joins drafts nothing until the next full plan);
a plan that drafts is held only for the same batch: the same requests in the same order, and a prefill chunk beside
them or none as before (such a step prices drafts otherwise). What holding can cost is bounded: a change
that would make another plan pay (a request's acceptance drifts, the load falls) is acted on at most `max_hold`
steps late."""
from __future__ import annotations


class PlanHold:
    def __init__(self, max_hold: int = 8) -> None:
        if not (isinstance(max_hold, int) and max_hold >= 1):
            raise ValueError(f"max_hold must be an integer >= 1, got {max_hold!r}")
        self.max_hold = max_hold
        self.hold = 0  # steps the last full plan holds for (0: plan every step)
        self.next_plan = 0  # the step of the next full plan
        self.batch: tuple = ()  # the last full plan's batch (its requests' ids, whether prefill rode along)
        self.ks: list[int] = []  # and its draft lengths
        self.held = 0  # steps held, in all (stats)

    def held_ks(self, step: int, batch: tuple, rows: int) -> list[int] | None:
        """The draft lengths this step's `rows` requests keep from the last full plan, or None where it plans in
        full. batch: what tells batches apart (GoodputPolicy: the requests' ids and whether prefill rides along)."""
        if step >= self.next_plan:
            return None
        if not any(self.ks):
            ks = [0] * rows
        elif batch == self.batch:
            ks = self.ks
        else:
            return None
        self.held += 1
        return ks

    def planned(self, step: int, batch: tuple, ks: list[int], probed: bool) -> None:
        """A full plan ran at `step`."""
        same = not any(ks) and not any(self.ks) or (batch == self.batch and ks == self.ks)
        self.hold = min(self.max_hold, 2 * self.hold if self.hold else 1) if same and not probed else 0
        self.next_plan = step + 1 + self.hold
        self.batch, self.ks = batch, list(ks)
