"""What the replica streams back for a generation: the engine's outputs as the wire's `Delta`s, and the batching
of deltas for an answer sent whole."""
from __future__ import annotations

import time

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


class HeldDeltas:
    """A streamed call gets a delta a step. An answer sent whole gets its first tokens at once (failover counts
    them as sent), then a batch at most every HELD_DELTAS_S: a message a token costs the ingress CPU for every
    token (and Ray's threads here more), taken from the decode step where the replica shares the ingress's cores."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self.held: Delta | None = None
        self.sent = time.monotonic()

    def add(self, delta: Delta) -> Delta | None:
        """The delta to send now (this one and any held before it, as one), or None while it is held."""
        self.held = delta if self.held is None else self.held.then(delta)
        if self.streamed or delta.first or delta.finished or time.monotonic() - self.sent >= HELD_DELTAS_S:
            out, self.held, self.sent = self.held, None, time.monotonic()
            return out
        return None
