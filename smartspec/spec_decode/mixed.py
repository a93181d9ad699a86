"""Two proposers, chosen per request each step: a draft model and suffix speculation (model-free lookups).

The policy sees every request's lookup tree before it chooses (`candidates`) and answers, per request, the
proposer and k (`Policy.choose_proposers`); `propose` then runs the draft model for the requests that drew it and
crops the others' lookup trees. A request moves between them from step to step; the draft model catches up on what
it did not see when a request comes back to it."""
from __future__ import annotations

from smartspec.engine.request import Request
from smartspec.policy.proposer_choice import DRAFT, LOOKUP
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.spec_decode.suffix import SuffixProposer
from smartspec.spec_decode.tree import TokenTree


class MixedProposer(Proposer):
    method = "mixed"

    def __init__(self, draft: Proposer, lookup: SuffixProposer) -> None:
        self.draft, self.lookup = draft, lookup

    @property
    def draft_available(self) -> bool:
        """False while the draft cannot propose (its actor restarting): the lookups go on alone."""
        return self.draft.available

    @property
    def failures(self) -> int | None:
        return getattr(self.draft, "failures", None)

    @property
    def incarnation(self):
        return getattr(self.draft, "incarnation", None)

    def candidates(self, requests: list[Request], budget: int) -> list[TokenTree]:
        return self.lookup.candidates(requests, budget)

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        methods = methods or [LOOKUP] * len(requests)
        draft_ks = [k if m == DRAFT else 0 for k, m in zip(ks, methods)]
        lookup_ks = [0 if m == DRAFT else k for k, m in zip(ks, methods)]
        self.last_catchup_tokens = 0
        chains = Proposal([[] for _ in requests], [None] * len(requests))
        if any(draft_ks):
            chains = self.draft.propose(requests, draft_ks)
            self.last_catchup_tokens = self.draft.last_catchup_tokens
        trees = self.lookup.propose(requests, lookup_ks).trees
        tokens = [c if m == DRAFT else t.tokens for c, t, m in zip(chains.tokens, trees, methods)]
        return Proposal(tokens, chains.probs, [None if m == DRAFT else t for t, m in zip(trees, methods)])

    def sync(self, request: Request) -> None:
        self.draft.sync(request)

    def finish(self, request: Request) -> None:
        self.lookup.finish(request)

    def release(self, request_id: str) -> None:
        self.draft.release(request_id)
        self.lookup.release(request_id)

    def close(self) -> None:
        if hasattr(self.draft, "close"):
            self.draft.close()
