"""Accept: per request due a token, the tokens a verify step yields (accepted drafts + one from the target), by the
lossless rules of rejection_sampler.py; requests without drafts sample their one token in one batched call, and the
step's tokens come to the host in one read."""
from __future__ import annotations

from collections.abc import Collection

import torch

from smartspec.runtime.logits_controls import reshape_logits
from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import draw_tokens, target_probs
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept_tree_sampled, greedy_path, greedy_run, sampled_verdict
from smartspec.structured.matcher import RequestGrammar, apply_masks


def accept_drafts(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
                  eos_token_ids: Collection[int] = (), grammars: dict[str, RequestGrammar] | None = None) \
        -> dict[str, list[int]]:
    """items: the step's forward items whose logits rows are `logits`, in order (an item with no rows yields no
    token); drafts: request -> its draft; grammars: structured requests' grammars at their committed tokens.

    Every row's argmax, each sampled chain's verdict and the plain rows' draws stay on the logits' device and come
    to the host in one read for the step; only a sampled token tree reads once per level of its own (which children
    it tries at a level depends on the level above)."""
    logits = controlled(items, logits, drafts, eos_token_ids, grammars or {})
    best = logits.argmax(dim=-1)
    on_device, at = [best], logits.shape[0]  # what the one read brings back, and where the next part starts
    out, verdicts, plain_rows, plain = {}, [], [], []
    row = 0
    for it in items:
        req, n = it.request, it.num_logits
        draft = drafts.get(req.request_id)
        if not n:
            continue
        if draft is None:
            plain_rows.append(row)
            plain.append(req)
        elif draft.tree is not None and not req.params.greedy:
            out[req.request_id] = accept_tree_sampled(target_probs(logits[row:row + n], req.params), draft.tree,
                                                      req.generator)
        elif req.params.greedy:
            verdicts.append((req.request_id, draft, row, n, None))
        else:
            on_device.append(sampled_verdict(target_probs(logits[row:row + n], req.params), draft.tokens,
                                             draft.probs, req.generator))
            verdicts.append((req.request_id, draft, row, n, at))
            at += 2
        row += n
    if plain:
        on_device.append(draw_tokens(logits[plain_rows], best[plain_rows], [r.params for r in plain],
                                     [r.generator for r in plain]))
    host = torch.cat(on_device).tolist()
    for request_id, draft, row, n, verdict in verdicts:
        if verdict is not None:  # a sampled chain: its accepted drafts, then the token drawn after them
            out[request_id] = list(draft.tokens[:host[verdict]]) + [host[verdict + 1]]
        elif draft.tree is not None:
            out[request_id] = greedy_path(host[row:row + n], draft.tree)
        else:
            out[request_id] = greedy_run(host[row:row + n], draft.tokens)
    out.update((r.request_id, [t]) for r, t in zip(plain, host[at:]))
    return out


def controlled(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
               eos_token_ids: Collection[int], grammars: dict[str, RequestGrammar]) -> torch.Tensor:
    """The logits with the rows of requests whose sampling controls or grammar read their history reshaped, and
    masked: row j of a chain after the first j draft tokens, a tree's node rows after the path to the node."""
    out, row = logits, 0
    for it in items:
        req, n = it.request, it.num_logits
        grammar = grammars.get(req.request_id)
        if n and (req.params.reshapes_logits or grammar is not None):
            draft = drafts.get(req.request_id)
            if draft is None:
                prefixes = [[]]
            elif draft.tree is not None:
                prefixes = [[]] + draft.tree.paths()
            else:
                prefixes = [draft.tokens[:j] for j in range(n)]
            if out is logits:
                out = logits.float().clone()
            if req.params.reshapes_logits:
                out[row:row + n] = reshape_logits(logits[row:row + n], req.params, req.prompt_token_ids,
                                                  req.output_token_ids, prefixes, eos_token_ids)
            if grammar is not None:  # in place, on the view of this request's rows
                apply_masks(out[row:row + n], *grammar.masks(prefixes))
        row += n
    return out
