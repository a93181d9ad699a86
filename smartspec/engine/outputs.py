"""What a request's caller receives after each step (RequestOutput), and the logprobs taken from a step's rows."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from smartspec.engine.step_logprobs import LogprobRows, logprobs_of, read_logprobs
from smartspec.runtime.model_runner import ForwardItem
from smartspec.types.faults import RequestFault, fault_of, stage
from smartspec.types.logprobs import TokenLogprob
from smartspec.types.metrics import RequestMetrics
from smartspec.types.request import Request


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: Sequence[int]  # all output tokens so far (types/request.py OutputTokens: a view, not a copy)
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error" (the server failed at its part of a step)
    num_prompt_tokens: int
    metrics: RequestMetrics
    new_logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once the prompt is computed, when asked
    error: str | None = None  # finish reason "error": what failed, naming the stage and feature


def take_prompt_logprobs(items: list[ForwardItem], logits: torch.Tensor, faults: dict[str, RequestFault]) \
        -> tuple[torch.Tensor, list[ForwardItem]]:
    """Record the prompt logprobs of chunks that computed every position's row; hand on the rows (and items)
    that sampling needs: a chunk's last row, when it completes its prompt, predicts the first new token. A request
    whose logprobs fail is entered in faults."""
    if all(it.request.prompt_logprobs is None for it in items):
        return logits, items
    keep, sampled, due, row = [], [], [], 0
    for it in items:
        req = it.request
        if req.prompt_logprobs is not None and it.num_logits == len(it.tokens) and len(it.tokens) \
                and it.start < req.num_prompt_tokens:
            completes = it.start + len(it.tokens) == req.num_tokens
            # row j predicts the prompt token after the chunk's j-th
            wanted = [(row + j, it.start + j + 1) for j in range(it.num_logits - completes)
                      if it.start + j + 1 < req.num_prompt_tokens and req.prompt_logprobs[it.start + j + 1] is None]
            due.append((req, [pos for _, pos in wanted], LogprobRows(
                req.request_id, [r for r, _ in wanted], [req.token_ids[pos] for _, pos in wanted],
                req.params.prompt_logprobs)))
            it_sampled = replace(it, num_logits=int(completes))
        else:
            it_sampled = it
        keep.extend(range(row + it.num_logits - it_sampled.num_logits, row + it.num_logits))
        sampled.append(it_sampled)
        row += it.num_logits
    read = read_logprobs(logits, [part for _, _, part in due])  # one host read for the step's chunks
    for req, positions, _ in due:
        try:
            with stage("logprobs"):
                for pos, logprob in zip(positions, logprobs_of(read, req.request_id), strict=True):
                    req.prompt_logprobs[pos] = logprob
        except Exception as exc:
            faults[req.request_id] = fault_of(exc, req.request_id, "logprobs")
    return logits[keep], sampled


def take_text(req: Request) -> str:
    """Text not streamed yet. While a request runs, the last (longest stop - 1) chars are held back: they
    may be the start of a stop string, which must never reach the client."""
    end = len(req.text)
    if not req.finished and req.params.stop:
        end = max(req.num_text_sent, end - max(map(len, req.params.stop)) + 1)
    new, req.num_text_sent = req.text[req.num_text_sent:end], end
    return new


def output_of(req: Request, added: list[int], new_text: str) -> RequestOutput:
    metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time, req.num_preemptions,
                             req.spec.copy())
    new_logprobs = req.logprobs[len(req.logprobs) - len(added):] if req.params.logprobs is not None else None
    return RequestOutput(req.request_id, added, new_text, req.output_tokens(), req.text, req.finished,
                         req.finish_reason, req.num_prompt_tokens, metrics, new_logprobs, req.prompt_logprobs,
                         req.error)
