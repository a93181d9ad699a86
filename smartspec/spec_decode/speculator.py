"""The speculative stages of a step: choose k, propose, accept. The engine orchestrates; this holds the swappable
parts (proposer, policy, K) and the spec-decode counters."""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from smartspec.engine.block_manager import BlockManager
from smartspec.engine.model_runner import ForwardItem
from smartspec.engine.request import Request
from smartspec.engine.sampler import sample_tokens
from smartspec.engine.scheduler import ScheduledRequest
from smartspec.policy import OffPolicy, Policy
from smartspec.policy.proposer_choice import DRAFT, LOOKUP
from smartspec.spec_decode.metrics import SpecDecodeMetrics
from smartspec.spec_decode.mixed import MixedProposer
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.spec_decode.rejection_sampler import accept, accept_tree
from smartspec.spec_decode.tree import TokenTree

logger = logging.getLogger(__name__)


class Draft(NamedTuple):
    tokens: list[int]  # a chain's draft tokens, or a tree's node tokens
    probs: torch.Tensor | None  # a chain's draft distributions (None: deterministic)
    tree: TokenTree | None = None


Drafts = dict[str, Draft]


class Speculator:
    def __init__(self, proposer: Proposer | None, policy: Policy, k_max: int) -> None:
        """No proposer: no speculation, whatever the policy."""
        self.proposer = proposer
        self.k_max = k_max
        self.policy = policy if proposer is not None else OffPolicy()
        self.metrics = SpecDecodeMetrics()
        # this step's proposer per decoding request, where the policy chose them (lookups); None otherwise
        self.methods: list[str] | None = None

    def choose(self, decoding: list[Request], budget: int, blocks: BlockManager, max_model_len: int,
               prefill: list[ScheduledRequest] = (), now: float | None = None) -> list[int]:
        """k per decoding request, capped so no draft goes past max_tokens, the context, the step's token budget
        or the free KV blocks; the blocks for the drafts are reserved here. prefill: the step's prefill chunks,
        which the policy sees as the rest of the step; now: the clock of requests' arrival_time (None: the
        engine's, time.monotonic()). A policy that fails or answers nonsense costs speculation
        for this step, never a request."""
        self.methods = None
        if self.proposer is None or not decoding or not self.proposer.available:
            return [0] * len(decoding)
        step = {"base_tokens": sum(s.num_tokens for s in prefill),
                "base_context": sum(s.request.num_computed_tokens + s.num_tokens for s in prefill),
                "prefilling": [s.request for s in prefill], "now": now}
        try:
            if hasattr(self.proposer, "candidates"):  # model-free lookups: the policy sees them before choosing
                lookups = self.proposer.candidates(decoding, self.k_max)
                use_draft = getattr(self.proposer, "draft_available", False)
                methods, ks = self.policy.choose_proposers(decoding, self.k_max, lookups, use_draft, **step)
                allowed = {LOOKUP, DRAFT} if use_draft else {LOOKUP}
                if len(methods) != len(decoding) or not set(methods) <= allowed:
                    raise ValueError(f"invalid proposers {methods!r} for {len(decoding)} requests")
            else:
                methods, ks = None, self.policy.choose(decoding, self.k_max, **step)
            if len(ks) != len(decoding) or any(not isinstance(k, int) or not 0 <= k <= self.k_max for k in ks):
                raise ValueError(f"invalid k {ks!r} for {len(decoding)} requests (K={self.k_max})")
        except Exception:
            logger.exception("policy %r failed; this step runs without speculation", self.policy.name)
            return [0] * len(decoding)
        self.methods = methods
        out = []
        for req, k in zip(decoding, ks):
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens - 1, budget)
            if req.params.max_speculative_tokens is not None:
                k = min(k, req.params.max_speculative_tokens)
            room = (len(req.block_table) + blocks.num_free) * blocks.block_size - req.num_tokens
            k = max(0, min(k, room))
            if k:
                blocks.allocate(req, req.num_tokens + k)
            budget -= k
            out.append(k)
        return out

    def propose(self, decoding: list[Request], ks: list[int]) -> Drafts:
        if self.proposer is not None:
            self.proposer.last_catchup_tokens = 0
        if self.proposer is None or not any(ks):
            return {}
        t0 = time.perf_counter()
        try:
            if self.methods is not None and isinstance(self.proposer, MixedProposer):
                proposal: Proposal = self.proposer.propose(decoding, ks, self.methods)
            else:
                proposal = self.proposer.propose(decoding, ks)
        except Exception:  # a failed proposer (a dead draft actor) costs speed, never a request
            logger.exception("proposer failed; this step runs without speculation")
            return {}
        if proposal.trees is None:
            return {r.request_id: Draft(t, q) for r, t, q in zip(decoding, proposal.tokens, proposal.probs) if t}
        if self.methods is not None:  # the policy chose on the lookups themselves: nothing to prune
            return {r.request_id: Draft(t, q, tree) for r, t, q, tree in
                    zip(decoding, proposal.tokens, proposal.probs, proposal.trees) if t}
        trees = proposal.trees
        try:
            trees = self.policy.prune(decoding, ks, trees, time.perf_counter() - t0)
        except Exception:
            logger.exception("policy %r failed to prune trees; verifying them whole", self.policy.name)
        return {r.request_id: Draft(t.tokens, None, t) for r, t in zip(decoding, trees) if len(t)}

    def accept(self, items: list[ForwardItem], logits: torch.Tensor, drafts: Drafts) -> dict[str, list[int]]:
        """Per request due a token: the tokens the step yields (accepted drafts + one from the target)."""
        out, plain_rows, plain = {}, [], []
        row = 0
        for it in items:
            if not it.num_logits:
                continue
            req = it.request
            draft = drafts.get(req.request_id)
            if draft is not None and draft.tree is not None:
                out[req.request_id] = accept_tree(logits[row:row + it.num_logits], draft.tree, req.params,
                                                  req.generator)
            elif draft is not None:
                out[req.request_id] = accept(logits[row:row + it.num_logits], draft.tokens, draft.probs, req.params,
                                             req.generator)
            else:
                plain_rows.append(row)
                plain.append(req)
            row += it.num_logits
        if plain:
            tokens = sample_tokens(logits[plain_rows], [r.params for r in plain], [r.generator for r in plain])
            out.update((r.request_id, [t]) for r, t in zip(plain, tokens))
        return out

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        req.spec.record(proposed, accepted)
        self.metrics.record(proposed, accepted)

    def sync(self, req: Request) -> None:
        if self.proposer is not None and not req.finished:
            self.proposer.sync(req)

    def release(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.finish(req)
            self.proposer.release(req.request_id)
        self.policy.release(req)
