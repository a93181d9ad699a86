"""Two proposers, chosen per request each step: a draft model and suffix speculation (model-free lookups).

The policy sees every request's lookup tree before it chooses (`lookups`, in the step's view) and plans, per
request, the proposer and k; `propose` then runs the draft model for the requests that drew it and crops the
others' lookup trees. A request moves between them from step to step; the draft model catches up on what it did
not see when a request comes back to it."""
from __future__ import annotations

from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.spec_decode.suffix import SuffixProposer
from smartspec.types.plan import DRAFT, LOOKUP
from smartspec.types.request import Request
from smartspec.types.tree import TokenTree


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
        return self.draft.failures

    @property
    def incarnation(self) -> str | None:
        return self.draft.incarnation

    def lookups(self, requests: list[Request], budget: int) -> list[TokenTree]:
        return self.lookup.lookups(requests, budget)

    def replayed_lookups(self, answers: list[tuple[list[int], list[int]]], budget: int) -> list[tuple[TokenTree,
                                                                                                       list[int]]]:
        return self.lookup.replayed_lookups(answers, budget)

    def drafting_part(self) -> Proposer:
        return self.draft.drafting_part()

    def held_tokens(self, requests: list[Request]) -> list[int] | None:
        return self.draft.held_tokens(requests)

    def source_of(self, choice: str) -> str:
        return self.draft.method if choice == DRAFT else self.lookup.method

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        methods = methods or [LOOKUP] * len(requests)
        draft_ks = [k if m == DRAFT else 0 for k, m in zip(ks, methods)]
        lookup_ks = [0 if m == DRAFT else k for k, m in zip(ks, methods)]
        chains = Proposal([[] for _ in requests], [None] * len(requests))
        if any(draft_ks):
            chains = self.draft.propose(requests, draft_ks)
        trees = self.lookup.propose(requests, lookup_ks).trees
        tokens = [c if m == DRAFT else t.tokens for c, t, m in zip(chains.tokens, trees, methods)]
        return Proposal(tokens, chains.probs, [None if m == DRAFT else t for t, m in zip(trees, methods)],
                        chains.catchup_tokens)

    def sync(self, request: Request) -> None:
        self.draft.sync(request)

    def finish(self, request: Request) -> None:
        self.lookup.finish(request)

    def release(self, request_id: str) -> None:
        self.draft.release(request_id)
        self.lookup.release(request_id)

    def close(self) -> None:
        self.draft.close()
