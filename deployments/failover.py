"""Failover: what becomes of a generation whose LLMServer replica fails (its process dies, or Ray cannot reach it).

The rules (`may_retry`), per generation (one choice of a request):
- Before its first token reached the caller, it is retried once on another replica: the same prompt and
  parameters (the same seed), a new request id that names the first as `retry_of`, so the goodput router sends
  it elsewhere. Usage counts the attempt that answered; the failed one is not billed.
- After its first token, a stream ends with its error event, as it would without failover: the caller has seen
  tokens that a retry could not take back.
- After its first token, a request that is not streamed is retried whole, once, when it is idempotent: greedy
  (temperature 0) or seeded. Its tokens so far are dropped (`RESTART`), never sent twice. An unseeded sampled
  request ends with a 500, as without failover.
A refusal (a replica's 4xx or 503 before acceptance) is an answer, not a failure: it is never retried here."""
from __future__ import annotations

import uuid
from collections.abc import Callable

from ray.exceptions import RayActorError

MAX_ATTEMPTS = 2  # the first try and one retry
RESTART = {"type": "restart"}  # a generation's earlier tokens are void: a whole retry starts over


def is_replica_failure(exc: BaseException) -> bool:
    """The replica died or is unreachable (ActorDiedError, ActorUnavailableError); not the request's own error."""
    return isinstance(exc, RayActorError)


def idempotent(params: dict) -> bool:
    """A retry gives the same answer: greedy decoding, or a seeded sampler."""
    return params.get("temperature") == 0 or params.get("seed") is not None


def may_retry(exc: BaseException, attempts: int, tokens_sent: bool, streaming: bool, params: dict) -> bool:
    if attempts >= MAX_ATTEMPTS or not is_replica_failure(exc):
        return False
    return not tokens_sent or (not streaming and idempotent(params))


class GenerationFailed(RuntimeError):
    """A retry was refused by the replica it reached (its first item an error): the generation fails with it."""


class FailoverStream:
    """One generation's items from LLMServer.generate, retried per the rules above. start(payload) opens a
    streaming handle call; the payload carries the request id a retry names. Items pass through unchanged, except
    that a retry's acceptance is not passed on again, and a whole retry is announced by RESTART."""

    def __init__(self, start: Callable[[dict], object], payload: dict, streaming: bool) -> None:
        self.start, self.streaming = start, streaming
        self.payload = {**payload, "request_id": payload.get("request_id") or uuid.uuid4().hex}
        self.stream = start(self.payload)
        self.attempts = 1
        self.accepted = False  # the caller has the acceptance item
        self.tokens_sent = False  # the caller has had a delta with tokens
        self.failures: list[BaseException] = []

    def __aiter__(self) -> FailoverStream:
        return self

    async def __anext__(self) -> dict:
        while True:
            try:
                item = await self.stream.__anext__()
            except StopAsyncIteration:
                raise
            except Exception as exc:
                if not may_retry(exc, self.attempts, self.tokens_sent, self.streaming,
                                 self.payload.get("params") or {}):
                    raise
                self.failures.append(exc)
                self._retry()
                if self.tokens_sent:
                    self.tokens_sent = False
                    return RESTART
                continue
            if item.get("type") == "accepted":
                if self.accepted:
                    continue  # a retry's acceptance: the caller already has one
                self.accepted = True
            elif item.get("type") == "error" and self.accepted:
                raise GenerationFailed(f"retry after {self.failures[-1]!r} was refused: {item.get('message')}")
            elif item.get("type") == "delta" and item.get("token_ids"):
                self.tokens_sent = True
            return item

    def _retry(self) -> None:
        self.attempts += 1
        self.payload = {**self.payload, "request_id": uuid.uuid4().hex, "retry_of": self.payload["request_id"]}
        self.stream = self.start(self.payload)

    def cancel(self) -> None:
        self.stream.cancel()
