"""The policy interface: each step, a typed view of the decoding requests in (`StepView`), a plan out (`SpecPlan`:
k in {0..K} per request, and the proposer where the view offers a choice). The policy sees numbers only: it
imports nothing from the engine, the runtime or the proposers, and learns from the `StepRecord` of each step."""
from __future__ import annotations

from smartspec.types.plan import DRAFT, LOOKUP, SpecPlan, StepView, TreePlan
from smartspec.types.step_record import StepRecord
from smartspec.types.tree import TokenTree


class Policy:
    name = "base"
    wants_profile = False  # True: the engine runs a short warm-up profile and passes it to observe_profile

    def plan(self, view: StepView) -> SpecPlan:
        """k in [0, view.k_max] per decoding request. Where the view holds lookups (candidate trees that cost no
        draft forward), also the proposer per request: here, this policy's k from the lookup where its tree holds
        that many nodes, else from the draft model (when it is available)."""
        ks = self.choose_ks(view)
        if view.lookups is None:
            return SpecPlan(ks)
        return SpecPlan(ks, [LOOKUP if len(t) >= k or not view.draft_available else DRAFT
                             for t, k in zip(view.lookups, ks)])

    def choose_ks(self, view: StepView) -> list[int]:
        """The k of each decoding request, for a policy whose plan is only that."""
        raise NotImplementedError

    def prune(self, view: StepView, ks: list[int], trees: list[TokenTree], draft_s: float) -> TreePlan:
        """Token trees as proposed for node budgets ks -> the trees to verify (a policy that weighs nodes drops
        some). draft_s: what proposing them took."""
        return TreePlan(trees)

    def observe_profile(self, records: list[StepRecord]) -> None:
        """The warm-up profile: measured step shapes that say nothing about acceptance."""

    def observe(self, record: StepRecord) -> None:
        """Called after every step; a policy that learns overrides it."""

    def release(self, request_id: str) -> None:
        """Called when a request ends."""

    def request_speed(self, batch_sizes: list[int], context: int, k_max: int) -> dict[int, float] | None:
        """Per b in batch_sizes: the tokens per second one request is expected to get while b requests of about
        `context` tokens decode together, at the speculation this policy would choose. None: the policy has no
        measure of it (routing and autoscaling then fall back to measured rates)."""
        return None

    def step_seconds(self, tokens: int, context: int) -> float | None:
        """The predicted time of a step of `tokens` batched tokens over `context` tokens of context, without drafts;
        None: the policy does not model step time."""
        return None

    # ---- state shared across replicas (a policy that learns shares it) --------------------------------------
    def export_state(self) -> dict | None:
        return None

    def import_state(self, state: dict) -> None:
        """Adopt the replicas' merged state (see replica_state.merge_states)."""

    def stats(self) -> dict:
        return {}
