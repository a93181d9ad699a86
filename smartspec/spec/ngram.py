"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's suffix."""
from __future__ import annotations

from smartspec.engine.request import Request
from smartspec.spec.proposer import Proposal, Proposer


def lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Longest suffix first (n_max down to n_min); the most recent earlier match wins."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        first = suffix[0]
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        tokens = [lookup(r.token_ids, k, self.n_max, self.n_min) if k > 0 else [] for r, k in zip(requests, ks)]
        return Proposal(tokens, [None] * len(requests))
