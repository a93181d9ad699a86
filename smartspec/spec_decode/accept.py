"""Accept: per request due a token, the tokens a verify step yields (accepted drafts + one from the target), by the
lossless rules of rejection_sampler.py; requests without drafts sample their one token in one batched call, and the
step's tokens come to the host in one read.

Seeded sampled requests take, at each position, the Gumbel-max token of noise keyed by (seed, position)
(runtime/sampler.seeded_tokens; the step's seeded rows drawn together, seeded_draws) and verify drafts against it
as greedy requests verify against the argmax: their output is seeded decoding's without speculation, whatever the
proposers offered.

Each request's part runs on its own: what fails in it (its logits controls, its grammar, its sampling, its
acceptance) becomes that request's fault (types/faults.py), and a row with no finite logit is never sampled: the
request whose output reaches it ends with a fault that names its controls."""
from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import NamedTuple

import torch

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import StagedRowControls
from smartspec.runtime.token_counts import TokenCounts
from smartspec.runtime.upload import HostBatch
from smartspec.spec_decode.controlled import ControlledParts
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.sampled_chains import StagedChains
from smartspec.spec_decode.sampled_trees import StagedTrees
from smartspec.spec_decode.step_rows import Part, StepRows, Verdicts
from smartspec.structured.matcher import RequestGrammar
from smartspec.types.faults import RequestFault


def accept_drafts(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
                  eos_token_ids: Collection[int] = (), grammars: dict[str, RequestGrammar] | None = None,
                  counts: TokenCounts | None = None) -> Verdicts:
    """items: the step's forward items whose logits rows are `logits`, in order (an item with no rows yields no
    token); drafts: request -> its draft; grammars: structured requests' grammars at their committed tokens;
    counts: penalized requests' histories kept between steps (runtime/token_counts.py; None: counted whole).

    The stage's host values (controls' values, grammars' masks, sampled rows' controls, sampled chains' and trees'
    layouts, plain rows) go in one copy; the sampled requests' probabilities, chain verdicts and tree walks are made
    together. Every row's chosen token (argmax, or a seeded request's), each sampled chain's verdict, each sampled
    tree's tokens and the plain rows' draws come to the host in one read for the step, with each row's liveness
    (a sampled tree verified alone, where the walk together failed, reads once a level of its own)."""
    faults: dict[str, RequestFault] = {}
    grammars = grammars or {}
    parts, row = [], 0
    for it in items:
        if it.num_logits:
            parts.append(Part(it.request, drafts.get(it.request.request_id), row, it.num_logits))
        row += it.num_logits
    batch = HostBatch()
    controlled = ControlledParts(items, logits, drafts, eos_token_ids, grammars, faults, batch, counts)
    plain = [p for p in parts if _is_plain(p) and p.request.request_id not in faults]
    plain_rows = batch.ints([p.start for p in plain]) if plain else None
    # one request's probabilities are made alone (target_probs): the batched pass's own operations would outweigh it
    plain_controls = StagedRowControls([p.request.params for p in plain], logits.shape[1], batch) \
        if len(plain) > 1 else None
    sampled = [p for p in parts if _is_sampled(p) and p.request.request_id not in faults]
    controls = StagedRowControls([p.request.params for p in sampled for _ in range(p.count)], logits.shape[1],
                                 batch) if len(sampled) > 1 else None
    layout = _SampledLayout.of(sampled, batch)
    sent = batch.send(logits.device)
    step = StepRows(logits, controlled.rows(logits, sent, faults), faults, plain,
                    None if plain_rows is None else sent[plain_rows],
                    None if plain_controls is None else plain_controls.on(sent))
    if controls is not None:
        step.sample_probs(sampled, controls.on(sent))
    if layout.chains is not None:
        step.verify_chains(layout.chain_parts, layout.chains, sent)
    if layout.trees is not None:
        step.verify_trees(layout.tree_parts, layout.trees, sent)
    for part in parts:
        if part.request.request_id not in faults and not _is_plain(part):
            step.take(part)
    step.draw_seeded(layout.seeded_parts, None if layout.seeded is None else sent[layout.seeded])
    step.draw_plain()
    return step.verdicts(step.read(), grammars)


class _SampledLayout(NamedTuple):
    """The step's sampled parts verified or drawn together, and their layouts staged in the step's batch: the
    chains', the trees', and the seeded parts' rows' places in the step's logits (a key of the batch)."""
    chain_parts: list[Part]
    chains: StagedChains | None
    tree_parts: list[Part]
    trees: StagedTrees | None
    seeded_parts: list[Part]
    seeded: int | None

    @classmethod
    def of(cls, sampled: list[Part], batch: HostBatch) -> _SampledLayout:
        chains = [p for p in sampled if _is_sampled_chain(p)]
        trees = [p for p in sampled if _is_sampled_tree(p)]
        seeded = [p for p in sampled if p.request.params.seed is not None]
        # each part's first row among the sampled parts' rows (where a chain or a tree reads them)
        at = dict(zip((p.request.request_id for p in sampled), itertools.accumulate((p.count for p in sampled),
                                                                                     initial=0))) \
            if chains or trees else {}
        staged_chains = StagedChains([p.draft for p in chains], [at[p.request.request_id] for p in chains], batch) \
            if chains else None
        staged_trees = StagedTrees([p.draft.tree for p in trees], [at[p.request.request_id] for p in trees], batch) \
            if trees else None
        places = batch.ints([r for p in seeded for r in range(p.start, p.start + p.count)]) if seeded else None
        return cls(chains, staged_chains, trees, staged_trees, seeded, places)


def _is_plain(part: Part) -> bool:
    """An unseeded sampled request without drafts: its one token is drawn with the others' (draw_tokens)."""
    params = part.request.params
    return part.draft is None and not params.greedy and params.seed is None


def _is_sampled(part: Part) -> bool:
    """A sampled request whose rows are verified or drawn by the noise of its seed (seeded, or with drafts): its
    target probabilities are made with the step's others (StepRows.sample_probs)."""
    return not part.request.params.greedy and not _is_plain(part)


def _is_sampled_chain(part: Part) -> bool:
    """An unseeded sampled request with a chain draft: its verdict compares the target's probabilities at the
    draft's tokens (sent with the step's values)."""
    params, draft = part.request.params, part.draft
    return draft is not None and draft.tree is None and bool(draft.tokens) and not params.greedy \
        and params.seed is None


def _is_sampled_tree(part: Part) -> bool:
    """An unseeded sampled request with a token tree: walked with the step's other such trees (sampled_trees.py)."""
    params, draft = part.request.params, part.draft
    return draft is not None and draft.tree is not None and not params.greedy and params.seed is None
