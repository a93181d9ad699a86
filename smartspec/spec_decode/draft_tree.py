"""The draft model grows a token tree per request, one lockstep draft forward per depth.

Depth by depth, the best frontier nodes (at most `branching` per request, by path probability) are fed to the draft
together, each seeing only its ancestors (the tree mask), and each yields `branching` candidate children: the most
probable tokens for greedy requests; for sampled requests, tokens drawn without replacement (Gumbel top-k) from the
draft distribution, which is kept for acceptance. The node budget's best candidates by path probability form the
tree. The fed nodes' KV stays in the draft cache; once the target has committed, the accepted path's entries are
moved next to the context and the rest is dropped, so the draft does not feed the accepted tokens again."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import seeded_noise, target_probs
from smartspec.spec_decode.draft_model import DraftModelProposer
from smartspec.spec_decode.proposer import Proposal
from smartspec.types.request import Request
from smartspec.types.tree import MAX_TREE_NODES, TokenTree, best_first, capped_scores, signed64


@dataclass
class _Growth:
    """One request's candidates while its tree grows (candidate -1 is the root, the last committed token)."""
    index: int  # the request's row in the batch
    ds: Request  # the draft's mirror of the request
    budget: int
    width: int
    rounds: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # path probability under the draft
    confidences: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    stored: dict[int, int] = field(default_factory=dict)  # fed candidate -> its cache position
    masks: dict[int, int] = field(default_factory=dict)  # fed candidate (and -1) -> ancestor bits from the root
    child_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def root(self) -> int:
        return self.ds.num_tokens - 1  # cache position and sequence position of the root


class DraftTreeProposer(DraftModelProposer):
    def __init__(self, *args, max_depth: int, branching: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_depth, self.branching = max_depth, branching
        self.grown: dict[str, tuple[int, dict[tuple[int, int], int], dict[int, int]]] = {}

    # ---- after the target committed: keep the accepted path's KV ------------------------------------------
    def _sync_state(self, req: Request) -> Request:
        ds, grown = self.state.get(req.request_id), self.grown.pop(req.request_id, None)
        if ds is not None and grown is not None:
            root_len, child_of, stored = grown
            src, node = [], -1
            if ds.num_computed_tokens == root_len and req.token_ids[:root_len] == ds.token_ids[:root_len]:
                for tok in req.token_ids[root_len:-1]:  # the last token is fed again: its logits are needed
                    node = child_of.get((node, tok), -2)
                    if node not in stored:
                        break
                    src.append(stored[node])
            dst = list(range(root_len, root_len + len(src)))
            if src != dst:
                self.runner.copy_kv([self.blocks.slot(ds, p) for p in src], [self.blocks.slot(ds, p) for p in dst])
            ds.token_ids = ds.token_ids[:root_len] + req.token_ids[root_len:root_len + len(src)]
            ds.num_computed_tokens = root_len + len(src) if src else ds.num_computed_tokens
        return super()._sync_state(req)

    def release(self, request_id: str) -> None:
        self.grown.pop(request_id, None)
        super().release(request_id)

    # ---- growing -------------------------------------------------------------------------------------------
    def _expand(self, fed: list[tuple[_Growth, int, Request]], logits: torch.Tensor) -> None:
        """Add `branching` candidate children to each fed node of one depth (logits row r after fed[r]): greedy
        rows by the draft's probability, sampled ones by a Gumbel top-k draw (an ordered draw without replacement).
        Every node's candidates come to the host in one read for the depth, not a few reads per child."""
        qs, keys = [], []
        for row, (g, node, req) in enumerate(fed):
            if req.params.greedy:
                q = self._fit_vocab(torch.softmax(logits[row].float(), dim=-1))
                keys.append(q)
            else:
                q = self._fit_vocab(target_probs(logits[row], req.params))
                if req.params.seed is not None:  # the noise the target's token is drawn with at the children's
                    depth = 1 if node < 0 else g.depths[node] + 1  # position: its first child is the likeliest
                    exp = seeded_noise(req.params.seed, [req.num_tokens + depth - 1], q.shape[-1], q.device)[0]
                else:
                    exp = -torch.rand(q.shape, generator=req.generator, device=q.device).clamp_(min=1e-20).log()
                keys.append(q.log() - exp.log())
                g.child_probs[node] = q
            qs.append(q)
        q = torch.stack(qs)
        top = torch.topk(torch.stack(keys), min(self.branching, q.shape[-1]), dim=-1).indices
        # token ids are exact in float64, so one tensor brings both back
        tokens, probs = torch.stack([top.double(), q.gather(1, top).double()]).tolist()
        for (g, node, _), node_tokens, node_probs in zip(fed, tokens, probs):
            parent_score = 1.0 if node < 0 else g.scores[node]
            depth = 1 if node < 0 else g.depths[node] + 1
            for tok, p in zip(node_tokens, node_probs):
                if p <= 0.0:  # the filters (top-k, top-p, a grammar) left fewer than `branching` candidates
                    break
                g.tokens.append(int(tok))
                g.parents.append(node)
                g.confidences.append(p)
                g.scores.append(parent_score * p)
                g.depths.append(depth)

    @torch.inference_mode()
    def _start_growth(self, requests: list[Request], ks: list[int]) -> list[_Growth]:
        """A growing tree per request with a node budget, its draft state synced and its cache slots held."""
        growing: list[_Growth] = []
        for i, (req, k) in enumerate(zip(requests, ks)):
            if k <= 0:
                continue
            budget = min(k, MAX_TREE_NODES)
            width, rounds = min(self.branching, budget), min(self.max_depth, budget)
            ds = self._sync_state(req)
            fed = width * (rounds - 1)
            if not self.blocks.can_hold(ds, req.num_tokens + fed):  # the draft's cache is full: no speculation
                continue
            self.blocks.allocate(ds, req.num_tokens + fed)
            growing.append(_Growth(i, ds, budget, width, rounds, masks={-1: 1}))
        return growing

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        growing = self._start_growth(requests, ks)
        catchup = sum(g.ds.num_tokens - g.ds.num_computed_tokens - 1 for g in growing)
        self._catch_up_in_chunks([g.ds for g in growing])
        if growing:  # depth 1: the draft reads every token it has not seen, through the root
            items = [ForwardItem(g.ds, g.ds.token_ids[g.ds.num_computed_tokens:], g.ds.num_computed_tokens, 1)
                     for g in growing]
            logits = self.runner.forward(items)
            for g in growing:
                g.ds.num_computed_tokens = g.ds.num_tokens
            self._expand([(g, -1, requests[g.index]) for g in growing], logits)
        for depth in range(1, max((g.rounds for g in growing), default=0)):
            active, items, fed = [g for g in growing if depth < g.rounds], [], []
            for g in active:
                eff = capped_scores(g.parents, g.scores, sibling_order=not requests[g.index].params.greedy)
                level = [c for c in range(len(g.tokens)) if g.depths[c] == depth]
                frontier = sorted(sorted(level, key=lambda c: (-eff[c], c))[:g.width])
                if not frontier:  # a top-k filter left no candidates at this depth
                    continue
                start = g.root + 1 + len(g.stored)
                for j, c in enumerate(frontier):
                    g.stored[c] = start + j
                    g.masks[c] = g.masks[g.parents[c]] | 1 << (start + j - g.root)
                items.append(ForwardItem(g.ds, [g.tokens[c] for c in frontier], start, len(frontier),
                                         positions=[g.root + depth] * len(frontier), tree_base=g.root,
                                         tree_masks=[signed64(g.masks[c]) for c in frontier]))
                fed.append((g, frontier))
            if not items:
                break
            self._expand([(g, c, requests[g.index]) for g, frontier in fed for c in frontier],
                         self.runner.forward(items))
        trees = [TokenTree([], [], []) for _ in requests]
        for g in growing:
            trees[g.index] = best_first(g.tokens, g.parents, g.scores, g.confidences, g.child_probs, limit=g.budget,
                                        sibling_order=not requests[g.index].params.greedy)
            child_of = {(g.parents[c], g.tokens[c]): c for c in range(len(g.tokens))}
            self.grown[g.ds.request_id] = (g.ds.num_tokens, child_of, g.stored)
        return Proposal([t.tokens for t in trees], [None] * len(requests), trees, catchup)
