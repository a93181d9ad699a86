"""The narrow proposer interface, so a proposer can live in-process or behind a Ray actor."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from smartspec.engine.request import Request
from smartspec.spec_decode.tree import TokenTree


@dataclass
class Proposal:
    tokens: list[list[int]]  # per request, up to its k draft tokens (fewer when the proposer has none)
    # per request, the draft distribution [len(tokens), V] each token was drawn from; None = deterministic
    # (greedy request, or a model-free proposer): q is then one-hot at the token.
    probs: list[torch.Tensor | None]
    # tree proposers: per request, its token tree (tokens then lists the tree's node tokens); None = chains
    trees: list[TokenTree | None] | None = None


class Proposer:
    method = "base"
    # tokens the last propose() fed beyond one per request (a draft model catching up): a one-time cost per
    # request that the cost model fits apart from the per-step draft cost
    last_catchup_tokens = 0

    @property
    def available(self) -> bool:
        """False while the proposer cannot propose (a draft actor being restarted): steps then plan k = 0."""
        return True

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        raise NotImplementedError

    def sync(self, request: Request) -> None:
        """After the target committed: forget what the request's draft state holds past the agreed tokens."""

    def finish(self, request: Request) -> None:
        """The request ended with these tokens (a proposer that learns from outputs keeps them)."""

    def release(self, request_id: str) -> None:
        """The request ended: free its draft state."""
