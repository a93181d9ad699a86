"""From logits to tokens: greedy, or temperature / top-k / top-p sampling with per-request generators, and seeded
requests' tokens from noise keyed by (seed, position)."""
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
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """One token per row of logits [R, V], left on the logits' device (the step reads its tokens back once, not a
    row at a time): best, the rows' argmax, for the greedy rows; each sampled row drawn from its own generator.
    A row whose draw raises keeps its argmax and is returned by row with its exception: one request's failure is
    its own, never its neighbours'."""
    tokens, failed = [], {}
    for row, p in enumerate(params):
        token = best[row:row + 1]
        if not p.greedy:
            try:
                token = torch.multinomial(target_probs(logits[row], p), 1, generator=generators[row])
            except Exception as exc:
                failed[row] = exc
        tokens.append(token)
    # the rows' tokens in place, put together on the device (no index of the drawn rows to send)
    return (torch.cat(tokens) if tokens else best), failed


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """A generator seed for the noise at one position of a seeded request: splitmix64 of (seed, position), so
    neighbouring seeds and positions get unrelated streams."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_noise(seed: int, positions: list[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[n, vocab] Exp(1) draws for a seeded request at these token positions, from a generator keyed by (seed,
    position) alone, clamped away from 0 (p / 0 would be inf, or NaN for p = 0, which argmax would take)."""
    noise = torch.empty(len(positions), vocab, device=device)
    for i, pos in enumerate(positions):
        noise[i].exponential_(generator=torch.Generator(device=device).manual_seed(noise_seed(seed, pos)))
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def seeded_tokens(probs: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:
    """probs [n, V]: the distributions of a seeded request at these token positions. Its tokens by the Gumbel-max
    rule, argmax p / E with E = seeded_noise(seed, position): each token is an exact draw from p, and it depends on
    nothing but p, the seed and the position, not on what a proposer offered, on the batch or on how many uniforms
    anything drew before. So a seeded request repeats itself, and under speculation a draft token is accepted
    exactly where it equals this token (greedy verification against it). A draft model that draws its own tokens
    with the same noise (argmax q / E) proposes what the target will take wherever q and p agree."""
    return (probs / seeded_noise(seed, positions, probs.shape[-1], probs.device)).argmax(dim=-1)
