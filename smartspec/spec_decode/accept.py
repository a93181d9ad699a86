"""Accept: per request due a token, the tokens a verify step yields (accepted drafts + one from the target), by the
lossless rules of rejection_sampler.py; requests without drafts sample their one token in one batched call."""
from __future__ import annotations

import torch

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import sample_tokens
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept, accept_tree


def accept_drafts(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft]) -> dict[str, list[int]]:
    """items: the step's forward items whose logits rows are `logits`, in order (an item with no rows yields no
    token); drafts: request -> its draft."""
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
