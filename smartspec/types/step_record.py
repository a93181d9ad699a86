"""StepRecord: what one engine step did and cost. The engine writes one per step; policies learn from it, traces
store it, the simulator produces it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from smartspec.types.tree import TokenTree


class VerifiedTree(NamedTuple):
    """A token tree the target verified, and the nodes it accepted (root to leaf): what node confidences are
    calibrated on."""
    tree: TokenTree
    path: list[int]


@dataclass
class StepRecord:
    """What one engine step did and cost (what a learning policy fits on; written to traces)."""
    step: int
    batch_size: int  # requests in the forward
    ks: list[int]  # speculation length per decoding request (planned)
    proposed: list[int]  # draft tokens actually proposed per decoding request
    accepted: list[int]  # draft tokens accepted per decoding request
    request_ids: list[str]
    num_batched_tokens: int  # tokens in the target forward (decodes + drafts + prefill)
    num_prefill_tokens: int
    num_context_tokens: int  # sum of the context lengths the forward attends over
    draft_s: float
    verify_s: float
    total_s: float
    predicted_s: float | None = None  # the policy's prediction of total_s, when it makes one
    draft_catchup_tokens: int = 0  # tokens the draft model fed to catch up (beyond one per request)
    # the proposer each decoding request drew, where the policy chose them (None: one proposer serves all)
    methods: list[str] | None = None
    trees: dict[str, VerifiedTree] = field(default_factory=dict)  # request -> its verified tree, where it had one
    # token positions the forward computed: its padded bucket's cells (CUDA graphs), else None (= the batched tokens)
    forward_tokens: int | None = None
    num_tokens: list[int] = field(default_factory=list)  # each decoding request's length when the step was planned
    probes: list[str] = field(default_factory=list)  # the plan's exploration probes (SpecPlan.probes)
