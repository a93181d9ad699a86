"""Accept or reject draft tokens so that the output follows the target's distribution exactly."""
from __future__ import annotations

import torch

from smartspec.engine.sampler import target_probs
from smartspec.sampling_params import SamplingParams


def accept_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Longest prefix of the draft equal to the target's argmax, then the target's own next token."""
    best = target_logits.argmax(dim=-1).tolist()
    out = []
    for j, tok in enumerate(draft):
        if best[j] != tok:
            break
        out.append(tok)
    out.append(best[len(out)])
    return out


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """p [k+1, V]: target probabilities; q [k, V]: the draft's (None = one-hot at the draft tokens).

    Token j is accepted with probability min(1, p(x)/q(x)); the first rejection is replaced by a sample from
    norm(max(p - q, 0)) and ends the step; if all k are accepted, a bonus token is drawn from p[k]."""
    out = []
    for j, tok in enumerate(draft):
        q_tok = 1.0 if q is None else float(q[j, tok])
        p_tok = float(p[j, tok])
        u = float(torch.rand((), generator=generator))
        if u * q_tok < p_tok:  # u < p/q, without dividing by a q that may be tiny
            out.append(tok)
            continue
        if q is None:
            residual = p[j].clone()
            residual[tok] = 0.0
        else:
            residual = torch.clamp(p[j] - q[j], min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing to correct toward
            residual = p[j]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=generator)))
    return out


def accept(target_logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """The tokens a verify step yields for one request: accepted drafts plus one target token."""
    if params.greedy:
        return accept_greedy(target_logits, draft)
    return accept_sampled(target_probs(target_logits, params), draft, draft_probs, generator)
