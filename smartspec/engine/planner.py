"""Plan: the policy's view of a step, its plan, and the caps no plan may pass.

The policy sees numbers (`StepView`); what it answers (`SpecPlan`) is checked and capped here so that no draft goes
past a request's max_tokens, the context, the step's token budget or the free KV blocks, and the blocks for the
drafts are reserved. A policy that fails or answers nonsense costs speculation for this step, never a request."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, sub

from smartspec.engine.scheduler import ScheduledRequest
from smartspec.policy import OffPolicy, Policy
from smartspec.runtime.block_manager import BlockManager
from smartspec.spec_decode.hints import Hint
from smartspec.spec_decode.proposer import Proposer
from smartspec.types.metrics import SpecDecodeMetrics
from smartspec.types.padding import PaddedShapes
from smartspec.types.plan import DRAFT, LOOKUP, PrefillView, RequestViews, SpecPlan, StepView, chunk_context
from smartspec.types.request import Request

logger = logging.getLogger(__name__)


@dataclass
class Speculation:
    """The swappable parts of speculation, and their counters: the proposer (None: no speculation, whatever the
    policy), the policy and k_max."""
    proposer: Proposer | None
    policy: Policy
    k_max: int
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)

    def __post_init__(self) -> None:
        if self.proposer is None:
            self.policy = OffPolicy()

    @classmethod
    def off(cls) -> Speculation:
        return cls(None, OffPolicy(), 0)


_REQUEST_ID, _TOKEN_IDS = attrgetter("request_id"), attrgetter("token_ids")
_PROMPT_IDS, _ARRIVAL = attrgetter("prompt_token_ids"), attrgetter("arrival_time")
_MAX_TOKENS, _K_CAP = attrgetter("params.max_tokens"), attrgetter("params.k_cap")


def _view_columns(decoding: list[Request]) -> tuple[list, ...]:
    """RequestViews' columns past the ids and contexts, read from the requests in C (map, attrgetter), no Python
    per request: num_output_tokens, max_tokens, k_cap, arrival_time. Read while the step plans, before it commits
    a token, as the ids and contexts were."""
    outputs = list(map(sub, map(len, map(_TOKEN_IDS, decoding)), map(len, map(_PROMPT_IDS, decoding))))
    return outputs, list(map(_MAX_TOKENS, decoding)), list(map(_K_CAP, decoding)), list(map(_ARRIVAL, decoding))


_INT_TYPES = {int, bool}  # what isinstance(k, int) takes


def step_view(decoding: list[Request], prefill: list[ScheduledRequest], k_max: int, now: float | None = None,
              lookups=None, draft_available: bool = False, shapes: PaddedShapes | None = None,
              held_of: Callable[[list[Request]], list[int] | None] | None = None) -> StepView:
    """The step as the policy sees it: the decoding requests, and the prefill chunks as the rest of the step (those
    that complete a prompt: the next step's newcomers). held_of: the proposer's held_tokens."""
    joining = [s.request for s in prefill if s.completes]
    return StepView(_views(decoding, held_of), k_max,
                    prefill_tokens=sum(s.num_tokens for s in prefill),
                    prefill_context=sum(chunk_context(s.request.num_computed_tokens, s.num_tokens) for s in prefill),
                    prefilling=[PrefillView(s.request.request_id, s.request.arrival_time) for s in prefill],
                    now=now, lookups=lookups, draft_available=draft_available, shapes=shapes,
                    joining=_views(joining, held_of) if joining else None)


def _views(requests: list[Request], held_of=None) -> RequestViews:
    return RequestViews(requests, tuple(map(_REQUEST_ID, requests)), list(map(len, map(_TOKEN_IDS, requests))),
                        _view_columns, held_of)


@dataclass(frozen=True)
class DraftRoom:
    """Where a step's drafts must fit: the step's tokens left for them, the KV blocks, and the context bound."""
    budget: int
    blocks: BlockManager
    max_model_len: int


def plan_step(spec: Speculation, decoding: list[Request], prefill: list[ScheduledRequest], room: DraftRoom,
              now: float | None = None, hints: list[Hint] | None = None,
              shapes: PaddedShapes | None = None) -> tuple[StepView | None, SpecPlan]:
    """The step's view (None where no policy was asked) and its plan, capped, with the drafts' blocks reserved.
    room: where the drafts must fit; now: the clock of arrival_time (None: time.monotonic()); hints: the
    drafts requests carry (spec_decode/hints.py), offered to the policy as lookups beside the proposer's own;
    shapes: the buckets the target's forward is padded to (ModelRunner.padded_shapes)."""
    b = len(decoding)
    proposer = spec.proposer
    if proposer is None or not decoding or not proposer.available:
        return None, SpecPlan([0] * b)
    try:
        own = proposer.lookups(decoding, spec.k_max)
        lookups, draft_available = own, proposer.draft_available if own is not None else False
        if hints is not None:  # the configured proposer is then the alternative to each request's lookup
            lookups = [h.tree if h.source or own is None else own[i] for i, h in enumerate(hints)]
            draft_available = proposer.draft_available if own is not None else proposer.available
        view = step_view(decoding, prefill, spec.k_max, now, lookups, draft_available, shapes,
                         proposer.held_tokens)
        plan = spec.policy.plan(view)
        _check(plan, view)
    except Exception:
        logger.exception("policy %r failed; this step runs without speculation", spec.policy.name)
        return None, SpecPlan([0] * b)
    ks = plan.ks
    if hints is not None and own is None:  # a lookup chosen where there is none drafts nothing
        ks = [0 if m == LOOKUP and not len(t) else k for k, m, t in zip(ks, plan.methods, lookups)]
    ks = cap_and_reserve(ks, decoding, room)
    return view, SpecPlan(ks, plan.methods, plan.predicted_s, plan.probes)


def _check(plan: SpecPlan, view: StepView) -> None:
    b, k_max = len(view.requests), view.k_max
    if view.lookups is not None:
        allowed = {LOOKUP, DRAFT} if view.draft_available else {LOOKUP}
        if plan.methods is None or len(plan.methods) != b or not set(plan.methods) <= allowed:
            raise ValueError(f"invalid proposers {plan.methods!r} for {b} requests")
    ks = plan.ks
    # in C, not an isinstance per request: at 256 requests the check was a tenth of the engine's policy time
    if len(ks) != b or (ks and (not set(map(type, ks)) <= _INT_TYPES or min(ks) < 0 or max(ks) > k_max)):
        raise ValueError(f"invalid k {plan.ks!r} for {b} requests (K={k_max})")


def cap_and_reserve(ks: list[int], decoding: list[Request], room: DraftRoom) -> list[int]:
    """Each k capped by the request's max_tokens and own cap, the context, the step's token budget and the free
    KV blocks; the blocks for the drafts are allocated. Read from each request's lists directly, and the block
    manager asked only where the drafts cross into a new block (once in block_size tokens): one pass in turn,
    since the budget and the free blocks each request takes are not left to those after it."""
    if not any(ks):  # no speculation: nothing to cap or reserve (a loaded batch's steady state, walked for nothing)
        return list(ks)
    budget, blocks, max_model_len = room.budget, room.blocks, room.max_model_len
    size, free = blocks.block_size, blocks.num_free
    out = []
    for req, k in zip(decoding, ks):
        n, params = len(req.token_ids), req.params
        k = min(k, params.max_tokens - (n - len(req.prompt_token_ids)) - 1, max_model_len - n - 1, budget)
        if params.k_cap is not None:
            k = min(k, params.k_cap)
        if k > 0:
            held = len(req.block_table)
            # blocks.blocks_for(n + k), inline: a method call a request twice was a tenth of this loop at 256
            if -(-(n + k) // size) - held > free:  # as far as the free blocks reach
                k = max(0, min(k, (held + free) * size - n))
            if k and -(-(n + k) // size) > held:
                blocks.allocate(req, n + k)
                free = blocks.num_free
        else:
            k = 0
        budget -= k
        out.append(k)
    return out
