"""speculative_config, in the ecosystem's shape: {"method", "model", "num_speculative_tokens", ...}."""
from __future__ import annotations

from dataclasses import dataclass, fields

from smartspec.policy.base import Policy

METHODS = ("draft_model", "ngram")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    model: str | None = None  # the draft model, for method="draft_model"
    num_speculative_tokens: int = 4  # K: the most any request speculates in one step
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # "smartspec" (goodput), "off", "fixed" (k = K), "fixed:K", "batch_table", or a Policy instance
    policy: str | Policy = "smartspec"
    batch_table: dict[int, int] | None = None  # for policy "batch_table": {batch size: k}
    policy_options: dict | None = None  # for policy "smartspec": prior_alpha, explore_interval, ...

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model' (the draft model)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        if not isinstance(self.policy, (str, Policy)):
            raise ValueError(f"policy must be a name or a Policy, got {type(self.policy).__name__}")
        from smartspec.policy.base import make_policy
        make_policy(self.policy, k, self.batch_table, options=self.policy_options)  # names and options checked now

    @property
    def key(self) -> str:
        """What acceptance priors are shared by: the proposer and, for a draft model, which one."""
        return f"{self.method}:{self.model}" if self.method == "draft_model" else self.method

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**value)
