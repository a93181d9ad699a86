"""Accept: per request due a token, the tokens a verify step yields (accepted drafts + one from the target), by the
lossless rules of rejection_sampler.py; requests without drafts sample their one token in one batched call."""
from __future__ import annotations

from collections.abc import Collection

import torch

from smartspec.runtime.logits_controls import reshape_logits
from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import sample_tokens
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept, accept_tree
from smartspec.structured.matcher import RequestGrammar, apply_masks


def accept_drafts(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
                  eos_token_ids: Collection[int] = (), grammars: dict[str, RequestGrammar] | None = None) \
        -> dict[str, list[int]]:
    """items: the step's forward items whose logits rows are `logits`, in order (an item with no rows yields no
    token); drafts: request -> its draft; grammars: structured requests' grammars at their committed tokens."""
    logits = controlled(items, logits, drafts, eos_token_ids, grammars or {})
    out, plain_rows, plain = {}, [], []
    row = 0
    for it in items:
        if not it.num_logits:
            continue
        req = it.request
        draft = drafts.get(req.request_id)
        if draft is not None and draft.tree is not None:
            out[req.request_id] = accept_tree(logits[row:row + it.num_logits], draft.tree, req.params, req.generator)
        elif draft is not None:
            out[req.request_id] = accept(logits[row:row + it.num_logits], draft.tokens, draft.probs, req.params,
                                         req.generator)
        else:
            plain_rows.append(row)
            plain.append(req)
        row += it.num_logits
    if plain:
        tokens = sample_tokens(logits[plain_rows], [r.params for r in plain], [r.generator for r in plain])
        out.update((r.request_id, [t]) for r, t in zip(plain, tokens))
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
