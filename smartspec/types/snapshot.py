"""What a serving replica reads of its engine between two steps (LLMEngine.snapshot): typed, so the replica reads
fields by name and the /status view is made from them in one place (`EngineSnapshot.as_dict`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from smartspec.types.metrics import SpecDecodeMetrics


@dataclass(frozen=True)
class StepTotals:
    """Running totals over an engine's steps (engine/step_stats.py)."""
    steps: int = 0
    busy_s: float = 0.0  # seconds spent in steps
    draft_s: float = 0.0  # of which proposing
    verify_s: float = 0.0  # of which the target's forward
    generated_tokens: int = 0  # tokens the steps committed (before stops cut them)
    goodput_tokens_per_s: float = 0.0  # generated_tokens / busy_s
    chosen_k: dict[int, int] = field(default_factory=dict)  # k -> decoding requests that ran with it
    prediction_mean_abs_rel_error: float | None = None  # the policy's predicted step time against the measured
    policy_ms_per_step: float = 0.0  # the policy's planning (its view included) and observing, per step


@dataclass(frozen=True)
class LoadCosts:
    """What more load costs on this engine, from the policy's fits (None where it has none): routing and
    autoscaling read it (LLMEngine.load_costs)."""
    request_speed: dict[int, float] | None = None  # batch size -> tokens per second of one request
    prefill_s_per_token: float | None = None  # a prompt token's share of a prefill chunk's step


@dataclass(frozen=True)
class DraftHealth:
    """The configured proposer's state: whether it drafts now; for one behind a Ray actor, how often the actor
    failed and which start of it runs (None for one in the engine's process)."""
    available: bool
    failures: int | None = None
    incarnation: str | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    max_num_seqs: int
    policy_name: str
    prefix_queries: int  # prefix-cache lookups, and the hits among them
    prefix_hits: int
    spec_decode: SpecDecodeMetrics  # the engine's draft counters, a copy
    steps: StepTotals
    draft: DraftHealth | None  # None: no proposer configured
    # the policy's shareable evidence, in the policy's own form: the goodput controller merges the replicas'
    # (policy/replica_state.py) and hands the result back through import_policy_state
    policy_state: dict
    load: LoadCosts

    def as_dict(self, with_policy_state: bool = True) -> dict:
        """The replica's /status view of its engine (JSON): the fields, the counters with their rates, and unless
        left out, the policy's state (a controller report carries it apart)."""
        out = {"running": self.running, "waiting": self.waiting, "free_blocks": self.free_blocks,
                "total_blocks": self.total_blocks, "max_num_seqs": self.max_num_seqs, "policy_name": self.policy_name,
                "prefix_cache": {"queries": self.prefix_queries, "hits": self.prefix_hits},
                "spec_decode": self.spec_decode.as_dict(), "steps": asdict(self.steps),
                "draft_available": None if self.draft is None else self.draft.available,
                "draft_failures": None if self.draft is None else self.draft.failures,
                "draft_incarnation": None if self.draft is None else self.draft.incarnation,
                **asdict(self.load)}
        if with_policy_state:
            out["policy_state"] = self.policy_state
        return out
