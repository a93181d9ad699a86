"""What a serving replica needs of its engine (deployments/replica/server.py depends on this, not on AsyncEngine):
submit a request and stream its outputs, abort it, read the tokenizer and the context, the engine's snapshot and
load costs, and take the replicas' merged policy state. AsyncEngine is the implementation."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from smartspec.engine.outputs import RequestOutput
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.snapshot import EngineSnapshot, LoadCosts


class EngineClient(Protocol):
    tokenizer: object  # the model's (Hugging Face) tokenizer
    max_model_len: int
    kv_capacity_tokens: int
    num_in_flight: int  # requests accepted and not yet finished
    errored: BaseException | None  # what stopped the engine, if anything did

    def submit(self, prompt: str | list[int], params: SamplingParams | None,
               request_id: str) -> tuple[int, AsyncIterator[RequestOutput]]:
        """Validate and queue a request (bad input raises ValueError); its prompt length and output stream."""

    def discard(self, request_id: str) -> None:
        """Abort a submitted request whose stream may never have been iterated."""

    async def abort(self, request_id: str) -> None: ...

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    async def snapshot(self) -> EngineSnapshot: ...

    async def load_costs(self) -> LoadCosts: ...

    async def import_policy_state(self, state: dict) -> None: ...

    def warm_grammars(self) -> object:
        """Prepare structured outputs off the step thread."""

    def close(self) -> None: ...
