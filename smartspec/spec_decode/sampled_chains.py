"""A step's sampled chains verified together: every unseeded sampled request's chain draft accepted or rejected by
rejection_sampler.sampled_verdict's rule, in one pass over all of them, each request's draws taken from its
generator in the rule's order (its uniforms, then its residual's draw). With a generator of its own, each verdict
is bitwise the rule's alone; requests that share one (the engine's, for unseeded requests) take their uniforms
before any takes its draw, other numbers of the same law. A few device operations a step (a chain with a
generator of its own: two more), where the rule alone takes some twenty a request.

In two halves around the step's one copy of host values (runtime/upload.py HostBatch): the chains' layout (their
rows among the step's sampled probabilities, padded to the longest chain, their tokens, their draft
probabilities' rows, where each uniform goes) staged on the host; the verdicts made on the device once sent."""
from __future__ import annotations

import torch

from smartspec.runtime.sampler import draw_rows, uniforms
from smartspec.runtime.upload import HostBatch
from smartspec.spec_decode.proposer import Draft


class StagedChains:
    """The chains' layout, staged in a HostBatch. drafts: each chain's draft (k >= 1 tokens; probs [k or k + 1, V]
    or None, deterministic); starts: each chain's first row in the sampled probabilities it is verified against
    (k + 1 rows). Two chains or more (`verdicts`); of one, its tokens alone (sampled_verdict reads them)."""

    def __init__(self, drafts: list[Draft], starts: list[int], batch: HostBatch) -> None:
        self.drafts, self.width = drafts, max(len(d.tokens) for d in drafts)
        if len(drafts) == 1:  # one chain is verified by the rule alone (fewer operations): its tokens are all it reads
            self.tokens = batch.ints(drafts[0].tokens)
            return
        ks = [len(d.tokens) for d in drafts]
        q_lens = [0 if d.probs is None else d.probs.shape[0] for d in drafts]
        q_starts, at = [], 0  # a chain without draft probabilities reads row 0 (its reads are not used)
        for n in q_lens:
            q_starts.append(at if n else 0)
            at += n
        self.any_q = at > 0

        def padded(values_of) -> list[int]:  # one value per (chain, position), the chain's last repeated past it
            return [values_of(b, min(j, k - 1)) for b, k in enumerate(ks) for j in range(self.width)]

        self.k, self.starts = batch.ints(ks), batch.ints(starts)
        self.p_rows = batch.ints(padded(lambda b, j: starts[b] + j))
        self.tokens = batch.ints(padded(lambda b, j: drafts[b].tokens[j]))
        self.q_rows = batch.ints(padded(lambda b, j: q_starts[b] + min(j, max(0, q_lens[b] - 1))))
        self.q_starts, self.q_lens = batch.ints(q_starts), batch.ints(q_lens)
        self.u_at = batch.ints([b for b, k in enumerate(ks) for _ in range(k)]), \
            batch.ints([j for k in ks for j in range(k)])

    def verdicts(self, p: torch.Tensor, generators: list[torch.Generator | None],
                 sent: list[torch.Tensor]) -> torch.Tensor:
        """[B, 2]: each chain's accepted drafts and the token drawn after them (sampled_verdict's answer), on p's
        device; p: the step's sampled probabilities (every chain's k + 1 rows at its start)."""
        dev, b, width = p.device, len(self.drafts), self.width
        k, starts, tokens = sent[self.k], sent[self.starts], sent[self.tokens].view(b, width)
        p_tok = p[sent[self.p_rows].view(b, width), tokens]
        has_q = sent[self.q_lens] > 0
        if self.any_q:
            q = torch.cat([d.probs for d in self.drafts if d.probs is not None])
            q_tok = torch.where(has_q[:, None], q[sent[self.q_rows].view(b, width), tokens], 1.0)
        else:
            q_tok = torch.ones_like(p_tok)
        # each chain's uniforms from its own generator, in the rule's order (before its residual's draw); chains
        # sharing one (the engine's) take theirs in one draw
        u_flat = uniforms([len(d.tokens) for d in self.drafts], generators, dev)
        u = torch.ones(b, width, device=dev).index_put(tuple(sent[key] for key in self.u_at), u_flat)
        accepted = (u * q_tok < p_tok) & (torch.arange(width, device=dev)[None, :] < k[:, None])
        n = accepted.long().cumprod(1).sum(1)  # the accepted run before the first rejection
        last = p[starts + n]
        # a rejected deterministic draft: its token's mass goes; a rejected (or cut) sampled one: the draft's mass
        dropped = last.scatter(1, tokens.gather(1, n.clamp(max=k - 1)[:, None]), 0.0)
        residual = torch.where((n < k)[:, None], dropped, last)
        if self.any_q:
            q_lens = sent[self.q_lens]
            q_n = q[sent[self.q_starts] + torch.minimum(n, (q_lens - 1).clamp(min=0))]
            with_q = torch.where((n < q_lens)[:, None], torch.clamp(last - q_n, min=0.0), last)
            residual = torch.where(has_q[:, None], with_q, residual)
        # p == q up to rounding leaves no residual: the rejection had probability ~0, so draw from p
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0.0, residual, last)
        drawn = draw_rows(residual, generators)
        return torch.stack([n, drawn], dim=1)
