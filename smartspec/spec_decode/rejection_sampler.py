"""Accept or reject draft tokens so that the output follows the target's distribution exactly."""
from __future__ import annotations

import torch

from smartspec.runtime.sampler import draw, target_probs
from smartspec.runtime.upload import upload_lists
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree


def accept_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Longest prefix of the draft equal to the target's argmax, then the target's own next token."""
    return greedy_run(target_logits.argmax(dim=-1).tolist(), draft)


def greedy_run(best: list[int], draft: list[int]) -> list[int]:
    """accept_greedy over the target's argmax rows already on the host."""
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
    norm(max(p - q, 0)) and ends the step; if all k are accepted, a bonus token is drawn from p[k]. q [k+1, V]:
    the draft's (k+1)-th token was cut as one p forbids (a grammar), a certain rejection: the last token is then
    drawn from the residual norm(max(p[k] - q[k], 0)), as that rejection would have drawn it.

    The k uniforms are drawn at once and compared on p's device (independent draws: the same law as one at a
    time), and the residual is picked there too, so a request costs one read to the host, not two a draft token."""
    n_host, token = sampled_verdict(p, draft, q, generator).tolist()
    return list(draft[:n_host]) + [token]


def sampled_verdict(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                    generator: torch.Generator | None, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """accept_sampled's outcome left on p's device: [accepted drafts, the token drawn after them], so a step's
    requests come to the host together (the draft's first n tokens, then the token). tokens: the draft on p's
    device already (the accept stage sends every sampled chain's in one copy)."""
    k, dev = len(draft), p.device
    n = torch.zeros((), dtype=torch.long, device=dev)
    if k:
        rows = torch.arange(k, device=dev)
        tokens = upload_lists([draft], dev)[0] if tokens is None else tokens
        p_tok = p[rows, tokens]
        q_tok = torch.ones_like(p_tok) if q is None else q[rows, tokens]
        u = torch.rand(k, generator=generator, device=dev)
        accepted = u * q_tok < p_tok  # u < p/q, without dividing by a q that may be tiny
        n = accepted.long().cumprod(0).sum()  # the accepted run before the first rejection
    # indexed by a one-element tensor: a 0-d tensor index is read back to the host as a Python int
    last = last_or_residual = p[n.view(1)][0]
    if q is None and k:  # a rejected deterministic draft: its token's mass goes
        dropped = last.scatter(0, tokens[n.clamp(max=k - 1).view(1)], 0.0)
        last_or_residual = torch.where(n < k, dropped, last)
    elif q is not None and q.shape[0]:  # a rejected (or cut) sampled draft: the draft's mass at that position goes
        q_n = q[n.clamp(max=q.shape[0] - 1).view(1)][0]
        last_or_residual = torch.where(n < q.shape[0], torch.clamp(last - q_n, min=0.0), last)
    # p == q up to rounding leaves no residual: the rejection had probability ~0, so draw from p
    residual = torch.where(last_or_residual.sum() > 0.0, last_or_residual, last)
    return torch.cat([n.view(1), draw(residual, generator)])


def accept_tree_greedy(target_logits: torch.Tensor, tree: TokenTree) -> list[int]:
    """target_logits [1 + n, V]: row 0 after the root, row i + 1 after node i. The deepest path whose every token
    is the target's argmax after its parent, then the target's own next token."""
    return greedy_path(target_logits.argmax(dim=-1).tolist(), tree)


def greedy_path(best: list[int], tree: TokenTree) -> list[int]:
    """accept_tree_greedy over the target's argmax rows already on the host."""
    out, node = [], -1
    while True:
        tok = best[node + 1]
        nxt = tree.child(node, tok)
        out.append(tok)
        if nxt is None:
            return out
        node = nxt


def accept_tree_sampled(p: torch.Tensor, tree: TokenTree, generator: torch.Generator | None) -> list[int]:
    """p [1 + n, V]: target probabilities after the root and after each node. Recursive rejection sampling: at a node,
    its children are tried in draw order, child x with probability min(1, r(x) / q'(x)), where r is the target's
    residual (each rejected sibling's draft mass removed: r <- norm(max(r - q', 0))) and q' the draft distribution
    the sibling was drawn from (without the siblings drawn before it; one-hot for deterministic drafts). An accepted
    child is descended into; when all are rejected, the residual is sampled and the step ends. Each trial is an
    exact speculative-sampling step for the current residual, so the output follows the target alone.

    A node's trials run on p's device with every child's uniform drawn at once, and the residual after all of them
    is sampled before knowing whether it is needed (an unused independent draw changes no law): one host read per
    level of the tree, not several per child."""
    out, node = [], -1
    while True:
        children = tree.children(node)
        residual = p[node + 1]
        q = tree.child_probs.get(node)
        trials = []
        if children:
            u = torch.rand(len(children), generator=generator, device=p.device)
        for j, child in enumerate(children):
            tok = tree.tokens[child]
            q_tok = 1.0 if q is None else q[tok]
            trials.append(u[j] * q_tok < residual[tok])
            if q is None:
                nxt = residual.clone()
                nxt[tok] = 0.0
            else:
                nxt = torch.clamp(residual - q, min=0.0)
                q = q.clone()
                q[tok] = 0.0
                q_mass = q.sum()
                q = torch.where(q_mass > 0, q / q_mass, q)
            mass = nxt.sum()  # 0: r == q' up to rounding, the rejection had probability ~0; r stays
            residual = torch.where(mass > 0.0, nxt / mass, residual)
        drawn = draw(residual, generator)
        *accepted, token = torch.cat([torch.stack(trials).long(), drawn] if trials else [drawn]).tolist()
        first = next((j for j, a in enumerate(accepted) if a), None)
        if first is None:
            out.append(token)
            return out
        out.append(tree.tokens[children[first]])
        node = children[first]


def accept_tree(target_logits: torch.Tensor, tree: TokenTree, params: SamplingParams,
                generator: torch.Generator | None) -> list[int]:
    if params.greedy:
        return accept_tree_greedy(target_logits, tree)
    return accept_tree_sampled(target_probs(target_logits, params), tree, generator)
