"""Impossible constraints, refused before a request is queued: controls under which no token can ever come at some
position the output must reach, so the request could only end in an error.

From the start, the tokens a request may take at its next position are those its grammar allows (all, without
one), less those logit_bias bans (-100, OpenAI's "ban"), less the end tokens while min_tokens holds the end back.
None left: refused, naming the fields that emptied the set. Exactly one left: the output must take it, so the walk
takes it and looks at the next position. Two or more: the output has a choice there, and nothing more is claimed
(the step's own guard ends a request that still reaches an empty row, naming its controls). So every refusal is a
proof, never a guess."""
from __future__ import annotations

from collections.abc import Collection

import torch

from smartspec.structured.matcher import RequestGrammar
from smartspec.types.sampling_params import ParamError, SamplingParams

BAN = -100.0  # a logit_bias this low is a ban (OpenAI: "-100 should result in a ban")
MAX_FORCED_WALK = 256  # positions followed where a single token is possible (a grammar's fixed text)


def refuse_impossible(params: SamplingParams, grammar: RequestGrammar | None, field: str | None, vocab_size: int,
                      end_token_ids: Collection[int]) -> None:
    """Raise ParamError if no output can satisfy these controls (see the module's docstring). grammar: the
    request's, at its start (walked and rolled back; left as it was); field: the request field it came from."""
    banned = sorted(t for t, b in params.logit_bias.items() if b <= BAN and t < vocab_size)
    ends = sorted({*params.stop_token_ids, *(() if params.ignore_eos else end_token_ids)})
    if grammar is None and len(banned) < vocab_size - (len(ends) if params.min_tokens else 0):
        return  # without a grammar only a ban of (nearly) every token can leave nothing
    taken = 0
    try:
        for position in range(min(params.max_tokens, MAX_FORCED_WALK)):
            if grammar is not None and grammar.finished:
                return  # a complete grammar ends the output here: a valid end
            allowed = grammar.allowed() if grammar is not None else torch.ones(vocab_size, dtype=torch.bool)
            by_grammar = bool(allowed.any())
            allowed[[t for t in banned if t < len(allowed)]] = False
            after_bans = bool(allowed.any())
            early = position < params.min_tokens
            if early:
                allowed[[t for t in ends if t < len(allowed)]] = False
            left = allowed.nonzero().flatten()
            if not len(left):
                raise _impossible(position, field, by_grammar, after_bans, params.min_tokens)
            token = int(left[0])
            if len(left) > 1 or grammar is None or token in ends:
                return  # a choice, or the output's end
            grammar.commit([token])  # the only token possible here: the output must take it
            taken += 1
    finally:
        if taken:
            grammar.matcher.rollback(taken)


def _impossible(position: int, field: str | None, by_grammar: bool, after_bans: bool, min_tokens: int) -> ParamError:
    """The refusal: which controls left nothing at that position, the most specific field named."""
    where = "the output's first token" if position == 0 else \
        f"output token {position} (the {position} before it are the only ones possible)"
    grammar = field or "the vocabulary"
    if not by_grammar:
        return ParamError(field or "structured_outputs", f"{grammar} admits no output: no token is allowed at {where}")
    if not after_bans:
        return ParamError("logit_bias", f"logit_bias bans (-100) every token {grammar} allows at {where}")
    return ParamError("min_tokens", f"min_tokens={min_tokens} holds the end back at {where}, where {grammar} allows "
                                    f"nothing else that logit_bias does not ban")
