"""What the replica streams back for a generation: the engine's outputs as the wire's `Delta`s, and the batching
of deltas into messages (an answer sent whole; a stream with an interval)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator

from deployments.wire import Delta, PredictionUsage, TokenEntry
from smartspec.engine.outputs import RequestOutput
from smartspec.types.logprobs import TokenLogprob

HELD_DELTAS_S = 1.0  # an answer sent whole: how long the replica may hold its tokens back


def token_entries(tokenizer, logprobs: list[TokenLogprob | None]) -> list[TokenEntry | None]:
    """Logprobs with each token's text, for the wire (None stays None: a prompt's first token, which nothing
    predicts)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return [None if lp is None else TokenEntry(text(lp.token_id), lp.logprob, tuple((text(t), v) for t, v in lp.top))
            for lp in logprobs]


def delta_of(out: RequestOutput, first: bool, tokenizer) -> Delta:
    """One engine output as the wire's delta; the last one carries the generation's draft counters."""
    if out.finished and out.finish_reason == "error":  # the engine ended it alone (its log has the traceback)
        return Delta("", [], len(out.token_ids), first, True, "error",
                     error=out.error or "the server ended the generation after an internal error")
    spec = out.metrics.spec_decode if out.finished else None
    return Delta(out.new_text, out.new_token_ids, len(out.token_ids), first, out.finished, out.finish_reason,
                 None if spec is None else spec.as_dict(),
                 None if spec is None else PredictionUsage(spec.accepted_prediction_tokens,
                                                           spec.rejected_prediction_tokens),
                 None if out.new_logprobs is None else token_entries(tokenizer, out.new_logprobs),
                 token_entries(tokenizer, out.prompt_logprobs) if first and out.prompt_logprobs is not None
                 else None)


async def held(deltas: AsyncGenerator[Delta, None], hold_s: float, timed: bool = True) -> AsyncIterator[Delta]:
    """The deltas as messages: each as it comes where hold_s is 0; else the first at once (the ingress sends
    headers on it, failover counts it as sent), then what came since as one delta at most every hold_s, and the
    last at once. A message a token costs the ingress and Serve's proxy CPU for every token (docs/benchmarks.md,
    "The serving path"). timed (a stream): held tokens are sent when hold_s has passed even if no more come (a
    request preempted, a slow step), by waiting on the next delta with a timeout instead of for it (a task per
    delta while tokens are held); untimed (an answer sent whole, read at its end), they wait for the next delta."""
    pending: Delta | None = None
    sent = time.monotonic()
    upcoming: asyncio.Future | None = None  # the next delta, awaited across timeouts (never cancelled mid-wait)
    try:
        while True:
            if pending is not None and upcoming is None and timed:
                upcoming = asyncio.ensure_future(anext(deltas))
            if upcoming is not None:
                done, _ = await asyncio.wait({upcoming}, timeout=max(0.0, sent + hold_s - time.monotonic()))
                if not done:  # held long enough
                    yield pending
                    pending, sent = None, time.monotonic()
                    continue
                nxt, upcoming = upcoming, None
                try:
                    delta = nxt.result()
                except StopAsyncIteration:
                    break
            else:
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    break
            pending = delta if pending is None else pending.then(delta)
            if hold_s <= 0 or delta.first or delta.finished or time.monotonic() - sent >= hold_s:
                yield pending
                pending, sent = None, time.monotonic()
        if pending is not None:
            yield pending
    finally:
        if upcoming is not None and not upcoming.done():  # the caller left while a delta was awaited
            upcoming.cancel()
            await asyncio.gather(upcoming, return_exceptions=True)
        await deltas.aclose()  # its own cleanup now, not when collected
