"""Sampling controls that reshape a request's logits from its history: presence, frequency and repetition
penalties, logit_bias and min_tokens (min_p acts on probabilities, in sampler.target_probs).

Each logits row is reshaped with the history it has in plain decoding: the prompt, the output so far and, under
speculation, the draft tokens before that row's position. Verification then checks the very distribution plain
decoding samples from, so greedy speculation stays token-for-token equal and sampled speculation exact."""
from __future__ import annotations

from collections.abc import Collection

import torch

from smartspec.types.sampling_params import SamplingParams


def reshape_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                   prefixes: list[list[int]], eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """logits [n, V] of one request; row i follows prompt + output + prefixes[i]. Returns float32 rows. Token ids
    past V (a draft whose vocabulary is padded shorter than the target's) are left out.

    Order as in vLLM and transformers: the penalties, then the bias, then min_tokens' mask; counts are exact
    integers, so a row reshaped here is bitwise the row plain decoding reshapes at that position."""
    x = logits.float().clone()
    n, vocab = x.shape
    dev = x.device
    counts = torch.zeros(n, vocab, device=dev)
    if output:
        counts += torch.bincount(torch.tensor(output, device=dev), minlength=vocab)[:vocab].float()
    for i, prefix in enumerate(prefixes):
        if prefix := [t for t in prefix if t < vocab]:
            counts[i].index_add_(0, torch.tensor(prefix, device=dev), torch.ones(len(prefix), device=dev))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if in_prompt := sorted(t for t in set(prompt) if t < vocab):
            seen[:, torch.tensor(in_prompt, device=dev)] = True
        penalised = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
        x = torch.where(seen, penalised, x)
    if params.frequency_penalty:
        x -= params.frequency_penalty * counts
    if params.presence_penalty:
        x -= params.presence_penalty * (counts > 0).float()
    if bias := {t: b for t, b in params.logit_bias.items() if t < vocab}:
        x[:, torch.tensor(list(bias), device=dev)] += torch.tensor(list(bias.values()), device=dev)
    if params.min_tokens:
        ends = sorted(t for t in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
                      if t < vocab)
        early = [i for i, prefix in enumerate(prefixes) if len(output) + len(prefix) < params.min_tokens]
        if ends and early:
            x[torch.tensor(early, device=dev)[:, None], torch.tensor(ends, device=dev)] = float("-inf")
    return x
