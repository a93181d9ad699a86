"""The policy interface: each step, k in {0..K} for every decoding request. The engine knows nothing of how k is
chosen: it calls `choose` and reports each finished step to `observe`."""
from __future__ import annotations

from collections.abc import Sequence

from smartspec.engine.request import Request
from smartspec.engine.step_record import StepRecord
from smartspec.policy.proposer_choice import DRAFT, LOOKUP


class Policy:
    name = "base"
    wants_profile = False  # True: the engine runs a short warm-up profile and passes it to observe_profile
    last_prediction: float | None = None  # predicted time of the step last chosen, if the policy predicts

    def choose(self, requests: list[Request], k_max: int, *, base_tokens: int = 0, base_context: int = 0,
               prefilling: Sequence[Request] = (), now: float | None = None) -> list[int]:
        """k in [0, k_max] per decoding request. base_tokens / base_context: the rest of the step (prefill
        chunks), which the verify forward carries anyway; prefilling: the requests those chunks belong to; now: the
        clock of the requests' arrival_time (time.monotonic() when None; a simulator passes its own)."""
        raise NotImplementedError

    def choose_proposers(self, requests: list[Request], k_max: int, lookups: list, use_draft: bool, *,
                         base_tokens: int = 0, base_context: int = 0, prefilling: Sequence[Request] = (),
                         now: float | None = None) -> tuple[list[str], list[int]]:
        """A model-free lookup (suffix speculation) ran before k is chosen: lookups holds each request's candidate
        tree. Per request, the proposer ("suffix", or "draft_model" where use_draft) and k. Here: this policy's k,
        from the lookup where its tree holds that many nodes (it costs no draft forward), else from the draft."""
        ks = self.choose(requests, k_max, base_tokens=base_tokens, base_context=base_context, prefilling=prefilling,
                         now=now)
        return [LOOKUP if len(t) >= k or not use_draft else DRAFT for t, k in zip(lookups, ks)], ks

    def prune(self, requests: list[Request], ks: list[int], trees: list, draft_s: float) -> list:
        """Token trees as proposed for node budgets ks -> the trees to verify (a policy that weighs nodes drops
        some)."""
        return trees

    def observe_profile(self, records: list[StepRecord]) -> None:
        """The warm-up profile: measured step shapes that say nothing about acceptance."""

    def observe(self, record: StepRecord) -> None:
        """Called after every step; a policy that learns overrides it."""

    def release(self, request: Request) -> None:
        """Called when a request ends."""
