"""Acceptance estimates: per request, shrunk toward a prior that is learned from all requests.

A step that proposed k tokens of which a were accepted gives a accepted tokens and one rejection if a < k: the
estimate accepted / (accepted + rejections) is then the probability that a proposed token is accepted given its
predecessors were (the alpha of the goodput model). Evidence decays with time, so a request that stops
proposing (k = 0) drifts back to the prior."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counts:
    accepted: float = 0.0
    rejected: float = 0.0

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor

    def add(self, accepted: float, rejected: float) -> None:
        self.accepted += accepted
        self.rejected += rejected


class AcceptanceEstimator:
    def __init__(self, prior_alpha: float = 0.5, prior_strength: float = 4.0, request_decay: float = 0.9,
                 prior_decay: float = 0.995, max_alpha: float = 0.99) -> None:
        self.initial_prior = prior_alpha
        self.prior_strength = prior_strength  # pseudo-observations the prior is worth against a request's own
        self.request_decay = request_decay
        self.prior_decay = prior_decay
        self.max_alpha = max_alpha  # alpha = 1 would make the goodput of k unbounded in k
        self.prior_counts = Counts()  # this engine's own evidence (what it exports)
        self.shared_counts = Counts()  # other replicas' evidence, as last received (replaced, never accumulated)
        self.requests: dict[str, Counts] = {}

    @property
    def prior(self) -> float:
        accepted = self.prior_counts.accepted + self.shared_counts.accepted
        rejected = self.prior_counts.rejected + self.shared_counts.rejected
        # the initial prior is itself worth prior_strength observations, so one lucky request cannot swing it
        a = accepted + self.initial_prior * self.prior_strength
        return min(self.max_alpha, a / (accepted + rejected + self.prior_strength))

    @property
    def evidence(self) -> float:
        """Proposal outcomes (decayed) behind the prior: this engine's and the other replicas'."""
        own, shared = self.prior_counts, self.shared_counts
        return own.accepted + own.rejected + shared.accepted + shared.rejected

    def alpha(self, request_id: str) -> float:
        c = self.requests.get(request_id)
        prior = self.prior
        if c is None:
            return prior
        a = c.accepted + prior * self.prior_strength
        return min(self.max_alpha, a / (c.accepted + c.rejected + self.prior_strength))

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        rejected = 1.0 if accepted < proposed else 0.0
        self.requests.setdefault(request_id, Counts()).add(accepted, rejected)
        self.prior_counts.decay(self.prior_decay)
        self.prior_counts.add(accepted, rejected)

    def tick(self, request_ids) -> None:
        """One step passed for these requests: older evidence weighs less (with none new, toward the prior)."""
        for rid in request_ids:
            c = self.requests.get(rid)
            if c is not None:
                c.decay(self.request_decay)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
