"""One step's numbers as the goodput policy plans on them: the view, each request's cap, the step's tokens and
context at k = 0, and the clock."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter

import numpy as np

from smartspec.types.plan import RequestView, StepView

# a batch's columns read in C (map), not in a Python loop over its rows
REQUEST_ID = attrgetter("request_id")
_FEW_ROWS = 16  # up to this many rows a column's numbers are quicker in a Python loop than in numpy


@dataclass
class StepNumbers:
    """The step's tokens and context come with it; its per-request columns are read from the view's when first
    needed (a step whose plan is held as no speculation reads none of them)."""
    view: StepView
    tokens: int  # the step's tokens at k = 0: the decoding requests' last tokens and the prefill chunks
    context: int  # and the context they attend over
    now: float  # the clock of arrival_time

    @classmethod
    def of(cls, view: StepView, now: float) -> StepNumbers:
        rows = view.requests
        return cls(view, view.prefill_tokens + len(rows), view.prefill_context + rows.context, now)

    @property
    def _columns(self) -> tuple:
        """The view's columns (RequestViews.columns): ids, contexts, outputs, max tokens, caps, arrivals."""
        return self.view.requests.columns()

    @property
    def ids(self) -> tuple[str, ...]:
        """The decoding requests' ids, in the view's order."""
        return self.view.requests.ids

    @cached_property
    def num_tokens(self) -> np.ndarray:
        """[B] each one's context (RequestView.num_tokens)."""
        return np.array(self.view.requests.num_tokens, dtype=np.float64)

    @cached_property
    def _left(self) -> np.ndarray:
        num_output, max_tokens = self._columns[2:4]
        return np.array(max_tokens, dtype=np.float64) - np.array(num_output, dtype=np.float64)

    @cached_property
    def remaining(self) -> np.ndarray:
        """[B] the tokens each may still generate (at least 1)."""
        return np.maximum(1.0, self._left)

    @cached_property
    def caps(self) -> list[int]:
        """The most each request may draft: the engine's K, its own cap, and one less than the tokens it has left."""
        if not self.view.requests:
            return []
        num_output, max_tokens, own = self._columns[2:5]
        k_max = self.view.k_max
        if len(num_output) <= _FEW_ROWS:  # numpy's overhead on a few rows is most of a small batch's held plan
            return [max(0, min(m - o - 1, k_max) if c is None else min(m - o - 1, c, k_max))
                    for o, m, c in zip(num_output, max_tokens, own)]
        caps = np.minimum(self._left - 1, k_max)
        if own.count(None) != len(own):  # a request without a cap of its own: NaN, which fmin skips
            caps = np.fmin(caps, np.array(own, dtype=np.float64))
        return np.maximum(caps, 0).astype(np.int64).tolist()

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
    def padded_tokens(self):
        """forward_tokens where the runner pads this step (a plan's tokens then depend on its depth); None where
        they are the step's tokens plus the drafts."""
        return self.forward_tokens if self.view.shapes is not None and not self.view.prefill_tokens else None

    @property
    def decode_context(self) -> int:
        """The decoding requests' context alone."""
        return self.context - self.view.prefill_context


def shape_of(view: StepView) -> tuple[int, int]:
    """The step's tokens and context at k = 0: its decoding requests' last tokens and its prefill chunks."""
    return view.prefill_tokens + len(view.requests), view.prefill_context + view.requests.context


def expected_tokens(gains: np.ndarray, ks: list[int]) -> float:
    """Tokens a step is expected to generate: one per request, and the gains of each request's first k drafts."""
    taken = np.arange(gains.shape[1])[None, :] < np.asarray(ks)[:, None]
    return len(ks) + float(gains[taken].sum())
