"""The state of one request as it moves through the engine."""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smartspec.types.block_table import BlockTable
from smartspec.types.logprobs import TokenLogprob
from smartspec.types.metrics import SpecDecodeMetrics
from smartspec.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class OutputTokens(Sequence[int]):
    """A request's output tokens as of one moment, read from its own token list, not copied: a request's tokens are
    only ever appended to while it lives, so the first `end` stay as they were. Equal to any sequence of the same
    tokens; pickled as a list. Each step hands every request's output on: a copy each would grow with the output.
    """
    __slots__ = ("_tokens", "_start", "_end")

    def __init__(self, tokens: list[int], start: int, end: int) -> None:
        self._tokens, self._start, self._end = tokens, start, end

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            a, b, step = index.indices(len(self))
            if step == 1:
                return self._tokens[self._start + a:self._start + max(a, b)]
            return [self._tokens[self._start + i] for i in range(a, b, step)]
        if not -len(self) <= index < len(self):
            raise IndexError("output token index out of range")
        return self._tokens[self._start + index % len(self)]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._end)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (OutputTokens, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity, not equal fields
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)  # prompt + output
    # Tokens whose KV is in the cache. A request is due for its next token when all but the last are computed.
    num_computed_tokens: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # finish reason "error": what failed, for its caller (types/faults.py)
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Output text, built incrementally; stop strings are cut from it.
    text: str = ""
    num_text_sent: int = 0  # chars of text already streamed
    spec: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    detok_stream: object | None = field(default=None, repr=False, compare=False)  # engine/detokenizer.py's decoder
    # filled only when params ask: per output token, and per prompt position (position 0 has none)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def output_tokens(self) -> OutputTokens:
        """Its output tokens as they are now, without copying them (output_token_ids copies)."""
        return OutputTokens(self.token_ids, self.num_prompt_tokens, len(self.token_ids))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
