"""A step's logprobs, every request's at once: the rows they come from gathered, log-softmax taken over them together
(row by row, so each row's values are the ones it has alone: types/logprobs.py), each token's value and rank and
each top size's most likely tokens computed on the logits' device, and all of it brought to the host in one read
for the step, where a token at a time read its row three times.

A request's part that cannot be read (its rows or tokens out of range) fails alone: the step's parts are then read
one by one, and the part that fails carries its exception to its request, whose commit ends it with a fault."""
from __future__ import annotations

from typing import NamedTuple

import torch

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.upload import upload_lists
from smartspec.spec_decode.accept import Verdicts
from smartspec.spec_decode.proposer import Draft
from smartspec.types.logprobs import TokenLogprob, rows_of_new_tokens


class LogprobRows(NamedTuple):
    """One request's logprobs due in a step: the logits rows that predicted its tokens, and how many of the most
    likely alternatives it asked for."""
    request_id: str
    rows: list[int]
    tokens: list[int]
    top: int


def step_logprobs(sampled: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
                  verdicts: Verdicts) -> dict[str, list[TokenLogprob] | Exception]:
    """The new tokens' logprobs of the step's requests that asked for them. sampled: the items whose logits rows
    are `logits`, in order; a token's row is the one that predicted it (rows_of_new_tokens)."""
    parts, failed, row = [], {}, 0
    for it in sampled:
        req, first = it.request, row
        row += it.num_logits
        rid, new = req.request_id, verdicts.tokens.get(req.request_id)
        if new is None or rid in verdicts.faults or req.params.logprobs is None:
            continue
        try:
            draft = drafts.get(rid)
            path = draft.tree.follow(new[:-1]) if draft is not None and draft.tree is not None else None
            parts.append(LogprobRows(rid, [first + r for r in rows_of_new_tokens(len(new), path)], new,
                                     req.params.logprobs))
        except Exception as exc:
            failed[rid] = exc
    return {**read_logprobs(logits, parts), **failed}


def read_logprobs(logits: torch.Tensor, parts: list[LogprobRows]) -> dict[str, list[TokenLogprob] | Exception]:
    """Each part's TokenLogprobs (or, where its part could not be read, the exception), by request."""
    if not parts:
        return {}
    try:
        return dict(zip((p.request_id for p in parts), _read(logits, parts)))
    except Exception:  # one part's bad rows must not cost the others their logprobs
        out: dict[str, list[TokenLogprob] | Exception] = {}
        for part in parts:
            try:
                out[part.request_id] = _read(logits, [part])[0]
            except Exception as exc:
                out[part.request_id] = exc
        return out


def logprobs_of(read: dict[str, list[TokenLogprob] | Exception], request_id: str) -> list[TokenLogprob]:
    """A request's part of read_logprobs' answer; raises what failed in reading it."""
    got = read[request_id]
    if isinstance(got, Exception):
        raise got
    return got


def _read(logits: torch.Tensor, parts: list[LogprobRows]) -> list[list[TokenLogprob]]:
    """The parts' TokenLogprobs, computed together on the logits' device and read in one tolist."""
    rows = [r for p in parts for r in p.rows]
    if not rows:
        return [[] for _ in parts]
    tops = [p.top for p in parts for _ in p.rows]
    vocab = logits.shape[-1]
    if any(not 0 <= r < logits.shape[0] for r in rows) or any(not 0 <= t < vocab for p in parts for t in p.tokens):
        raise IndexError("a logprob's row or token is out of range")
    sizes = sorted({n for n in tops if n})
    by_size = [[i for i, n in enumerate(tops) if n == size] for size in sizes]  # each top size's tokens
    index, tokens, *selected = upload_lists([rows, [t for p in parts for t in p.tokens], *by_size], logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    values = logprobs.gather(1, tokens[:, None])[:, 0]
    ranks = (logprobs > values[:, None]).sum(dim=-1) + 1
    found = [torch.topk(logprobs[sel], size, dim=-1) for sel, size in zip(selected, sizes)]
    # one read: float64 holds every float32 value and every token id and rank exactly
    host = torch.cat([values.double(), ranks.double(), *(torch.cat([t.indices.double().flatten(),
                                                                     t.values.double().flatten()]) for t in found)])
    host = host.tolist()
    m = len(rows)
    top_of: dict[int, tuple[tuple[int, float], ...]] = {}
    at = 2 * m
    for sel, size in zip(by_size, sizes):
        k = len(sel)
        ids, vals = host[at:at + k * size], host[at + k * size:at + 2 * k * size]
        for j, i in enumerate(sel):
            top_of[i] = tuple((int(ids[j * size + c]), vals[j * size + c]) for c in range(size))
        at += 2 * k * size
    out, i = [], 0
    for part in parts:
        got = []
        for token in part.tokens:
            got.append(TokenLogprob(token, host[i], int(host[m + i]), top_of.get(i, ())))
            i += 1
        out.append(got)
    return out
