"""The state of one request as it moves through the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smartspec.types.logprobs import TokenLogprob
from smartspec.types.metrics import SpecDecodeMetrics
from smartspec.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


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
    block_table: list[int] = field(default_factory=list)
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

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
