"""Failover: what becomes of a generation whose LLMServer replica fails (its process dies, or Ray cannot reach it).

The rules (`may_retry`), per generation (one choice of a request):
- Before its first token reached the caller, it is retried once on another replica: the same prompt and
  parameters (the same seed), a new request id that names the first as `retry_of` (`GenerateCall.retry`), so
  the goodput router sends it elsewhere. Usage counts the attempt that answered; the failed one is not billed.
- After its first token, a stream ends with its error event, as it would without failover: the caller has seen
  tokens that a retry could not take back.
- After its first token, a request that is not streamed is retried whole, once, whatever its sampling: its caller
  has seen nothing yet, so a fresh answer (a new draw, where it is sampled unseeded) is as good as the lost one. Its
  tokens so far are dropped (`Restart`), never sent twice.
A refusal (a replica's 4xx or 503 before acceptance) is an answer, not a failure: it is never retried here.

Nothing waits unbounded: each attempt waits at most `wait_s` for its replica's first event (a replica restarting
after a crash, every replica busy); then the generation fails with `NoReplicaInTime`, which the front answers with
a 503 and Retry-After."""
from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable

from ray.exceptions import RayActorError

from deployments.wire import Accepted, Delta, Event, GenerateCall, Refused, Restart

MAX_ATTEMPTS = 2  # the first try and one retry


def is_replica_failure(exc: BaseException) -> bool:
    """The replica died or is unreachable (ActorDiedError, ActorUnavailableError); not the request's own error."""
    return isinstance(exc, RayActorError)


def may_retry(exc: BaseException, attempts: int, tokens_sent: bool, streaming: bool) -> bool:
    if attempts >= MAX_ATTEMPTS or not is_replica_failure(exc):
        return False
    return not tokens_sent or not streaming


class GenerationFailed(RuntimeError):
    """A retry was refused by the replica it reached (its first event Refused): the generation fails with it."""


class NoReplicaInTime(RuntimeError):
    """No replica took the generation within wait_s: the caller may come back after retry_after_s."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"no replica took the request within {wait_s:g} s (replicas restarting or all busy); "
                         f"retry later")
        self.retry_after_s = max(1, math.ceil(wait_s))


class FailoverStream:
    """One generation's events from LLMServer.generate, retried per the rules above. start(call) opens a
    streaming handle call. Events pass through unchanged, except that a retry's acceptance is not passed on
    again, and a whole retry is announced by Restart."""

    def __init__(self, start: Callable[[GenerateCall], AsyncIterator[Event]], call: GenerateCall,
                 streaming: bool, wait_s: float = 60.0) -> None:
        self.start, self.streaming, self.call, self.wait_s = start, streaming, call, wait_s
        self.stream = start(call)
        self.attempts = 1
        self.attempt_answered = False  # this attempt's replica has sent its first event
        self.accepted = False  # the caller has the acceptance
        self.tokens_sent = False  # the caller has had a delta with tokens
        self.failures: list[BaseException] = []

    def __aiter__(self) -> FailoverStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            try:
                event = await self._next()
            except (StopAsyncIteration, NoReplicaInTime):
                raise
            except Exception as exc:
                if not may_retry(exc, self.attempts, self.tokens_sent, self.streaming):
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

    async def _next(self) -> Event:
        if self.attempt_answered:
            return await self.stream.__anext__()
        try:
            event = await asyncio.wait_for(self.stream.__anext__(), self.wait_s)
        except TimeoutError:
            self.cancel()
            raise NoReplicaInTime(self.wait_s) from None
        self.attempt_answered = True
        return event

    def _retry(self) -> None:
        self.attempts += 1
        self.attempt_answered = False
        self.call = self.call.retry()
        self.stream = self.start(self.call)

    def cancel(self) -> None:
        try:
            self.stream.cancel()
        except Exception:  # a call refused at submission re-raises its refusal here: it has nothing to stop
            pass
