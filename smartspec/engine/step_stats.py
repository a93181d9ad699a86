"""Running totals over an engine's steps, for serving metrics: what k was chosen, tokens per second of step time
(the measured goodput), how far the policy's predicted step time was from the measured one, and the host time the
policy itself took (planning and observing: on a GPU a share of every step)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from smartspec.types.snapshot import StepTotals
from smartspec.types.step_record import StepRecord


@dataclass
class StepStats:
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
        return StepTotals(self.steps, self.busy_s, self.draft_s, self.verify_s, self.generated_tokens,
                          self.generated_tokens / self.busy_s if self.busy_s else 0.0,
                          {int(k): n for k, n in sorted(self.chosen_k.items())},
                          self.prediction_abs_rel_error / self.predicted_steps if self.predicted_steps else None,
                          1e3 * self.policy_s / self.steps if self.steps else 0.0)
