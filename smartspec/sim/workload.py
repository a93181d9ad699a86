"""Simulated requests: their lengths and how often their drafts are accepted, drawn per request from a seed and the
request's index alone, so every policy of a comparison meets the same requests and the same luck (common random
numbers): a policy's ratio to another is then the policies', not the draws'."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RequestAcceptance:
    """A request's acceptance rate per draft token, `first` for its output's first `switch_at` tokens and `then`
    after (an answer that writes code, then prose about it), and the random stream its draft outcomes are drawn
    from."""
    first: float
    then: float
    switch_at: int
    rng: np.random.Generator

    def rate(self, output_tokens: int) -> float:
        return self.first if output_tokens < self.switch_at else self.then

    def expected_tokens(self, k: int, output_tokens: int) -> float:
        """Tokens a step that drafts k for this request is expected to give it: its own, and each draft with the
        chance that it and every one before it are accepted."""
        expected, reached = 1.0, 1.0
        for j in range(k):
            reached *= self.rate(output_tokens + j)
            expected += reached
        return expected

    def accepted(self, k: int, output_tokens: int) -> int:
        """Drafts accepted of k, each with the rate at its position, until the first rejection."""
        a = 0
        while a < k and self.rng.random() < self.rate(output_tokens + a):
            a += 1
        return a


@dataclass(frozen=True)
class SimRequestSpec:
    prompt_len: int
    max_tokens: int
    acceptance: RequestAcceptance


@dataclass(frozen=True)
class Workload:
    """acceptance "uniform": every request `alpha` throughout; "mixed": each request's rate uniform in `spread`,
    and in half the requests it changes, at a point drawn within the middle of the answer, to another such rate.
    Prompts and answers uniform within their ranges (tokens)."""
    acceptance: str = "uniform"
    alpha: float = 0.92
    spread: tuple[float, float] = (0.3, 0.95)
    prompt_len: tuple[int, int] = (64, 512)
    max_tokens: tuple[int, int] = (64, 256)

    def __post_init__(self) -> None:
        if self.acceptance not in ("uniform", "mixed"):
            raise ValueError(f"acceptance must be 'uniform' or 'mixed', got {self.acceptance!r}")
        if not (0 <= self.alpha <= 1 and 0 <= self.spread[0] <= self.spread[1] <= 1):
            raise ValueError(f"acceptance rates lie in [0, 1]: got {self}")
        if not (1 <= self.prompt_len[0] <= self.prompt_len[1] and 2 <= self.max_tokens[0] <= self.max_tokens[1]):
            raise ValueError(f"prompt and answer ranges must be ordered and positive: got {self}")

    def request(self, seed: int, index: int) -> SimRequestSpec:
        rng = np.random.default_rng([seed, index])
        prompt_len = int(rng.integers(self.prompt_len[0], self.prompt_len[1] + 1))
        max_tokens = int(rng.integers(self.max_tokens[0], self.max_tokens[1] + 1))
        if self.acceptance == "uniform":
            first = then = self.alpha
            switch_at = max_tokens
        else:
            first = then = float(rng.uniform(*self.spread))
            switch_at = max_tokens
            if rng.random() < 0.5:
                then = float(rng.uniform(*self.spread))
                switch_at = int(max_tokens * rng.uniform(0.3, 0.7))
        # the draft outcomes' own stream, apart from the draws above
        return SimRequestSpec(prompt_len, max_tokens,
                              RequestAcceptance(first, then, switch_at, np.random.default_rng([seed, index, 1])))
