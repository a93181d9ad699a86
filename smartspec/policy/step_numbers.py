"""One step's numbers as the goodput policy plans on them: the view, each request's cap, the step's tokens and
context at k = 0, and the clock."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smartspec.types.plan import RequestView, StepView


@dataclass
class StepNumbers:
    view: StepView
    k_max: list[int]  # the most each request may draft
    tokens: int  # the step's tokens at k = 0: the decoding requests' last tokens and the prefill chunks
    context: int  # and the context they attend over
    now: float  # the clock of arrival_time

    @classmethod
    def of(cls, view: StepView, now: float) -> StepNumbers:
        return cls(view, k_max_of(view), *shape_of(view), now)

    @property
    def requests(self) -> list[RequestView]:
        return self.view.requests

    def forward_tokens(self, drafted, depth: int):
        """Token positions the verify forward computes with `drafted` draft tokens (a number or an array), `depth`
        the longest chain: the step's tokens, or on a padded runner (view.shapes) its bucket's cells, since one
        chain of depth d widens every row to d + 1. A step with prefill chunks runs unpadded."""
        real = self.tokens + drafted
        shapes = self.view.shapes
        bucket = None if shapes is None or self.view.prefill_tokens else shapes.bucket(len(self.requests), depth + 1)
        return real if bucket is None else real * 0 + bucket[0] * bucket[1]

    @property
    def decode_context(self) -> int:
        """The decoding requests' context alone."""
        return self.context - self.view.prefill_context


def k_max_of(view: StepView) -> list[int]:
    """The most each request may draft: the engine's k_max, the request's own, and one short of its max_tokens."""
    return [max(0, min(view.k_max, r.max_tokens - r.num_output_tokens - 1,
                       view.k_max if r.k_max is None else r.k_max))
            for r in view.requests]


def shape_of(view: StepView) -> tuple[int, int]:
    """The step's tokens and context at k = 0: its decoding requests' last tokens and its prefill chunks."""
    return (view.prefill_tokens + len(view.requests),
            view.prefill_context + sum(r.num_tokens for r in view.requests))


def expected_tokens(gains: np.ndarray, ks: list[int]) -> float:
    """Tokens a step is expected to generate: one per request, and the gains of each request's first k drafts."""
    taken = np.arange(gains.shape[1])[None, :] < np.asarray(ks)[:, None]
    return len(ks) + float(gains[taken].sum())
