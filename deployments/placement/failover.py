"""Failover: what becomes of a generation whose LLMServer replica fails (its process dies, or Ray cannot reach it).

The rules (`may_retry`), per generation (one choice of a request):
- Before its first token reached the caller, it is retried once on another replica: the same prompt and
  parameters (the same seed), a new request id that names the first as `retry_of` (`GenerateCall.retry`), so
  the goodput router sends it elsewhere. Usage counts the attempt that answered; the failed one is not billed.
- After its first token, a stream ends with its error event, as it would without failover: the caller has seen
  tokens that a retry could not take back.
- After its first token, a request that is not streamed is retried whole, once, when it is idempotent: greedy
  (temperature 0) or seeded. Its tokens so far are dropped (`Restart`), never sent twice. An unseeded sampled
  request ends with a 500, as without failover.
A refusal (a replica's 4xx or 503 before acceptance) is an answer, not a failure: it is never retried here."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from ray.exceptions import RayActorError

from deployments.wire import Accepted, Delta, Event, GenerateCall, Refused, Restart

MAX_ATTEMPTS = 2  # the first try and one retry


def is_replica_failure(exc: BaseException) -> bool:
    """The replica died or is unreachable (ActorDiedError, ActorUnavailableError); not the request's own error."""
    return isinstance(exc, RayActorError)


def may_retry(exc: BaseException, attempts: int, tokens_sent: bool, streaming: bool, call: GenerateCall) -> bool:
    if attempts >= MAX_ATTEMPTS or not is_replica_failure(exc):
        return False
    return not tokens_sent or (not streaming and call.idempotent)


class GenerationFailed(RuntimeError):
    """A retry was refused by the replica it reached (its first event Refused): the generation fails with it."""


class FailoverStream:
    """One generation's events from LLMServer.generate, retried per the rules above. start(call) opens a
    streaming handle call. Events pass through unchanged, except that a retry's acceptance is not passed on
    again, and a whole retry is announced by Restart."""

    def __init__(self, start: Callable[[GenerateCall], AsyncIterator[Event]], call: GenerateCall,
                 streaming: bool) -> None:
        self.start, self.streaming, self.call = start, streaming, call
        self.stream = start(call)
        self.attempts = 1
        self.accepted = False  # the caller has the acceptance
        self.tokens_sent = False  # the caller has had a delta with tokens
        self.failures: list[BaseException] = []

    def __aiter__(self) -> FailoverStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            try:
                event = await self.stream.__anext__()
            except StopAsyncIteration:
                raise
            except Exception as exc:
                if not may_retry(exc, self.attempts, self.tokens_sent, self.streaming, self.call):
                    raise
                self.failures.append(exc)
                self._retry()
                if self.tokens_sent:
                    self.tokens_sent = False
                    return Restart()
                continue
            if isinstance(event, Accepted):
                if self.accepted:
                    continue  # a retry's acceptance: the caller already has one
                self.accepted = True
            elif isinstance(event, Refused) and self.accepted:
                raise GenerationFailed(f"retry after {self.failures[-1]!r} was refused: {event.message}")
            elif isinstance(event, Delta) and event.token_ids:
                self.tokens_sent = True
            return event

    def _retry(self) -> None:
        self.attempts += 1
        self.call = self.call.retry()
        self.stream = self.start(self.call)

    def cancel(self) -> None:
        self.stream.cancel()
