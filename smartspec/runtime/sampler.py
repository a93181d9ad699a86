"""From logits to tokens: greedy, or temperature / top-k / top-p sampling with per-request generators."""
from __future__ import annotations

import math

import torch

from smartspec.types.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [..., V] -> probs after temperature, min-p, top-k,
    top-p. Speculative acceptance applies the same function to target and draft logits."""
    x = logits.float() / params.temperature
    if params.min_p > 0:  # relative to the most likely token: log p < log(min_p) + max log p
        floor = x.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        x = x.masked_fill(x < floor, float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass before it is below top_p (the most likely token is always kept)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw_tokens(logits: torch.Tensor, best: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of logits [R, V], left on the logits' device (the step reads its tokens back once, not a
    row at a time): best, the rows' argmax, for the greedy rows; each sampled row drawn from its own generator."""
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        return best
    draws = [torch.multinomial(target_probs(logits[row], params[row]), 1, generator=generators[row])
             for row in sampled]
    return best.index_put((torch.tensor(sampled, device=logits.device),), torch.cat(draws))
