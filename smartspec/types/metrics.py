"""Spec-decode counters, with the meanings vLLM's use: a draft is one step in which a request proposed >= 1
token; mean acceptance length = 1 + accepted tokens / drafts (the tokens a verify step yields on average)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts whose token j was accepted
    # of the draft tokens, those from a predicted output (OpenAI's usage.completion_tokens_details)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # the three counters per source of the drafts: source -> [drafts, draft tokens, accepted tokens] (sources:
    # "draft_model", "ngram", "suffix", "grammar", "prediction")
    by_source: dict[str, list[int]] = field(default_factory=dict)
    _copy: SpecDecodeMetrics | None = field(default=None, init=False, repr=False, compare=False)  # copy()'s last

    def record(self, num_proposed: int, num_accepted: int, source: str | None = None) -> None:
        if num_proposed == 0:
            return
        self._copy = None
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if source is not None:
            counts = self.by_source.setdefault(source, [0, 0, 0])
            counts[0] += 1
            counts[1] += num_proposed
            counts[2] += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.extend([0] * (num_proposed - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def record_prediction(self, num_proposed: int, num_accepted: int) -> None:
        self._copy = None
        self.accepted_prediction_tokens += num_accepted
        self.rejected_prediction_tokens += num_proposed - num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> SpecDecodeMetrics:
        """The counters as they are now, apart from the ones that go on counting: one copy for as long as they
        stay as they are (every request's output carries one every step; without drafts they do not change), so
        a copy is read, never written."""
        if self._copy is not None:
            return self._copy
        # every field as it is, then its own lists: not dataclasses.replace, at several times the cost
        copied = SpecDecodeMetrics.__new__(SpecDecodeMetrics)
        copied.__dict__.update(self.__dict__)
        copied.accepted_per_position = list(self.accepted_per_position)
        copied.by_source = {source: list(counts) for source, counts in self.by_source.items()}
        self._copy = copied
        return copied

    def as_dict(self) -> dict:
        """The JSON form (a response's `speculation`, a replica's /status), with the derived rates."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.rejected_prediction_tokens,
                "by_source": {source: {"num_drafts": d, "num_draft_tokens": t, "num_accepted_tokens": a}
                              for source, (d, t, a) in sorted(self.by_source.items())}}


@dataclass(frozen=True)
class RequestMetrics:
    """A request's times (time.monotonic seconds) and draft counters, as of one of its outputs."""
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    spec_decode: SpecDecodeMetrics
