"""What a serving replica reads of its engine between two steps (LLMEngine.snapshot): typed, so the replica reads
fields by name and the /status view is made from them in one place (`EngineSnapshot.as_dict`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from smartspec.types.metrics import SpecDecodeMetrics
from smartspec.types.step_record import StepRecord


@dataclass
class StepTotals:
    """Running totals over an engine's steps, for serving metrics: what k was chosen, tokens per second of step time
    (the measured goodput), how far the policy's predicted step time was from the measured one, and the host time
    the policy itself took (planning and observing: on a GPU a share of every step). The engine adds each step;
    a snapshot is a copy."""
    steps: int = 0
    busy_s: float = 0.0  # seconds spent in steps
    draft_s: float = 0.0  # of which proposing
    verify_s: float = 0.0  # of which the target's forward
    generated_tokens: int = 0  # tokens the steps committed (before stops cut them)
    chosen_k: Counter = field(default_factory=Counter)  # k -> decoding requests that ran with it
    predicted_steps: int = 0
    prediction_abs_rel_error: float = 0.0  # summed |predicted - measured| / measured
    policy_s: float = 0.0  # seconds the policy planned (its view included) and observed

    def add(self, record: StepRecord, generated: int, policy_s: float = 0.0) -> None:
        self.steps += 1
        self.policy_s += policy_s
        self.busy_s += record.total_s
        self.draft_s += record.draft_s
        self.verify_s += record.verify_s
        self.generated_tokens += generated
        self.chosen_k.update(record.ks)
        if record.predicted_s is not None and record.total_s > 0:
            self.predicted_steps += 1
            self.prediction_abs_rel_error += abs(record.predicted_s - record.total_s) / record.total_s

    def snapshot(self) -> StepTotals:
        return replace(self, chosen_k=Counter(self.chosen_k))

    @property
    def goodput_tokens_per_s(self) -> float:
        return self.generated_tokens / self.busy_s if self.busy_s else 0.0

    @property
    def prediction_mean_abs_rel_error(self) -> float | None:
        return self.prediction_abs_rel_error / self.predicted_steps if self.predicted_steps else None

    @property
    def policy_ms_per_step(self) -> float:
        return 1e3 * self.policy_s / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        """The JSON form (a replica's /status)."""
        return {"steps": self.steps, "busy_s": self.busy_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "generated_tokens": self.generated_tokens, "goodput_tokens_per_s": self.goodput_tokens_per_s,
                "chosen_k": {int(k): n for k, n in sorted(self.chosen_k.items())},
                "prediction_mean_abs_rel_error": self.prediction_mean_abs_rel_error,
                "policy_ms_per_step": self.policy_ms_per_step}


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
    steps: StepTotals  # a copy
    draft: DraftHealth | None  # None: no proposer configured
    # the policy's shareable evidence, in the policy's own form: the goodput controller merges the replicas'
    # (policy/replica_state.py) and hands the result back through import_policy_state
    policy_state: dict | None  # None: a policy that shares nothing
    load: LoadCosts

    def as_dict(self, with_policy_state: bool = True) -> dict:
        """The replica's /status view of its engine (JSON): the fields, the counters with their rates, and unless
        left out, the policy's state (a controller report carries it apart)."""
        out = {"running": self.running, "waiting": self.waiting, "free_blocks": self.free_blocks,
                "total_blocks": self.total_blocks, "max_num_seqs": self.max_num_seqs, "policy_name": self.policy_name,
                "prefix_cache": {"queries": self.prefix_queries, "hits": self.prefix_hits},
                "spec_decode": self.spec_decode.as_dict(), "steps": self.steps.as_dict(),
                "draft_available": None if self.draft is None else self.draft.available,
                "draft_failures": None if self.draft is None else self.draft.failures,
                "draft_incarnation": None if self.draft is None else self.draft.incarnation,
                **asdict(self.load)}
        if with_policy_state:
            out["policy_state"] = self.policy_state
        return out
