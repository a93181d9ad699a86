"""The policy interface: each step, a typed view of the decoding requests in (`StepView`), a plan out (`SpecPlan`:
k in {0..K} per request, and the proposer where the view offers a choice). The policy sees numbers only: it
imports nothing from the engine, the runtime or the proposers, and learns from the `StepRecord` of each step."""
from __future__ import annotations

from smartspec.policy.load_model import LoadModel
from smartspec.types.plan import DRAFT, LOOKUP, SpecPlan, StepView, TreePlan
from smartspec.types.step_record import StepRecord
from smartspec.types.tree import TokenTree


class SharedEvidence:
    """What a policy shares with the other replicas' policies through the goodput controller (`Policy.shared`):
    nothing, here; a policy that learns exports its evidence and adopts the others' merged
    (replica_state.merge_states)."""

    def export_state(self) -> dict | None:
        return None

    def import_state(self, state: dict) -> None:
        """Adopt the replicas' merged state."""


class Policy:
    """plan, prune, plan_ahead, observe, release. What routing and autoscaling read of it is `load`; what replicas
    share, `shared`."""
    name = "base"
    wants_profile = False  # True: the engine runs a short warm-up profile and passes it to observe_profile
    load: LoadModel = LoadModel()
    shared: SharedEvidence = SharedEvidence()

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

    def observe_calibration(self, records: list[StepRecord]) -> None:
        """The start's calibration (engine/profile.py): draft-model chains on real text, for acceptance alone (their
        costs, measured beside a prefill or at a context the profile did not choose, are not the profile's)."""

    def observe_lookup_calibration(self, replayed: list[tuple[TokenTree, list[int]]]) -> None:
        """The start's calibration of lookup trees: what suffix speculation would have offered along the calibration
        answers, each tree with the path the answer takes through it (Proposer.replayed_lookups)."""

    def plan_ahead(self, view: StepView) -> None:
        """Called beside each step's forward with the step's view (engine/step_observer.py), after the last step was
        observed: a policy may make the next step's plan now, while a device runs the forward."""

    def observe(self, record: StepRecord) -> None:
        """Called for every step, beside the next step's forward; a policy that learns overrides it."""

    def release(self, request_id: str) -> None:
        """Called when a request ends."""

    def stats(self) -> dict:
        return {}
