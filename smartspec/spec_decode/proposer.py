"""The one proposer interface. Every proposer (in-process or behind a Ray actor, one method or several chosen per
request) implements all of it, so callers never ask what a proposer is: the defaults here say "one proposer, always
available, nothing to look up before planning, no per-request state"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from smartspec.types.request import Request
from smartspec.types.tree import TokenTree

if TYPE_CHECKING:
    import torch


@dataclass
class Proposal:
    tokens: list[list[int]]  # per request, up to its k draft tokens (fewer when the proposer has none)
    # per request, the draft distribution [len(tokens), V] each token was drawn from; None = deterministic
    # (greedy request, or a model-free proposer): q is then one-hot at the token.
    probs: list[torch.Tensor | None]
    # tree proposers: per request, its token tree (tokens then lists the tree's node tokens); None = chains
    trees: list[TokenTree | None] | None = None
    # tokens a draft model fed beyond one per request to catch up on what it had not seen: a one-time cost per
    # request that the cost model fits apart from the per-step draft cost
    catchup_tokens: int = 0


class Draft(NamedTuple):
    """One request's draft for the verify step."""
    tokens: list[int]  # a chain's draft tokens, or a tree's node tokens
    probs: torch.Tensor | None  # a chain's draft distributions (None: deterministic)
    tree: TokenTree | None = None
    # who made it: the proposer's method ("draft_model", "ngram", "suffix") or a hint's source ("grammar",
    # "prediction", spec_decode/hints.py); counted apart in the spec-decode metrics
    source: str | None = None


class Proposer:
    method = "base"
    # a proposer behind a Ray actor counts the actor's failures and names its incarnation (for stats)
    failures: int | None = None
    incarnation: str | None = None

    @property
    def available(self) -> bool:
        """False while the proposer cannot propose (a draft actor being restarted): steps then plan k = 0."""
        return True

    @property
    def draft_available(self) -> bool:
        """Whether a draft model can run this step: where lookups offer a choice, whether it can be chosen."""
        return False

    def lookups(self, requests: list[Request], budget: int) -> list[TokenTree] | None:
        """Candidate trees that cost no model forward, found before the policy plans (suffix speculation beside a
        draft model), so the policy chooses on them; None: this proposer offers none."""
        return None

    def replayed_lookups(self, answers: list[tuple[list[int], list[int]]], budget: int) -> list[tuple[TokenTree,
                                                                                                       list[int]]]:
        """The lookups this proposer would have offered along known answers (prompt, output), each with the path the
        answer takes through it: calibration evidence for lookup trees (engine/profile.py); [] where it offers none."""
        return []

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        """Up to ks[i] draft tokens (or tree nodes) for each request; methods: the proposer each request drew,
        where the plan chose them (only proposers that offer lookups get them)."""
        raise NotImplementedError

    def source_of(self, choice: str) -> str:
        """The label a draft is counted under when the plan chose `choice` (DRAFT or LOOKUP) for its request: the
        method of the proposer that makes it."""
        return self.method

    def held_tokens(self, requests: list[Request]) -> list[int] | None:
        """Per request, the tokens of its context this proposer would not read before drafting for it now: those
        it holds state for, or, for a request it never drafted for, those its prefix cache holds (a prompt that
        shares a system prompt or an earlier turn with one the draft read). What the policy leaves out of a
        catch-up's price; None: a proposer that keeps no such state (nothing to catch up on, or a simulator's)."""
        return None

    def drafting_part(self) -> Proposer:
        """The proposer whose forwards cost (what the warm-up profile measures): the draft beside lookups."""
        return self

    def sync(self, request: Request) -> None:
        """After the target committed: forget what the request's draft state holds past the agreed tokens."""

    def finish(self, request: Request) -> None:
        """The request ended with these tokens (a proposer that learns from outputs keeps them)."""

    def release(self, request_id: str) -> None:
        """The request ended: free its draft state."""

    def close(self) -> None:
        """The engine is closing: stop what the proposer started (an actor)."""
