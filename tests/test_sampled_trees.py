"""Sampled token trees walked together (spec_decode/sampled_trees.py): the recursive rejection rule for every tree of
a step at once, level by level on the device, nothing read back until the step's one read. Where the target leaves
no chance, each tree's tokens are exactly the rule's alone; otherwise they follow the target's distribution (a
chi-square test, as the rule's own in test_rejection_sampler.py), for trees of every shape in one batch."""
import random

import numpy as np
import torch
from host_reads import HostReads
from test_accept import Copies
from test_rejection_sampler import P_ROOT, V, _chi2_pvalue, _p_next, _random_tree

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.upload import HostBatch
from smartspec.spec_decode.accept import accept_drafts
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept_tree_sampled
from smartspec.spec_decode.sampled_trees import StagedTrees
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree


def walked(trees: list[TokenTree], probs: list[torch.Tensor], gen: torch.Generator) -> list[list[int]]:
    """The trees walked together against their probabilities [1 + n, V] (stacked one after another), read once."""
    starts = np.cumsum([0] + [len(p) for p in probs])[:-1].tolist()
    batch = HostBatch()
    staged = StagedTrees(trees, starts, batch)
    sent, rows = batch.send(torch.device("cpu")), torch.cat(probs)
    with HostReads() as reads:
        tokens, going = staged.verdicts(rows, [gen] * len(trees), sent)
    assert reads.seen == []
    host = torch.cat([tokens.flatten(), going.flatten().long()]).tolist()
    return [staged.tokens_of(host, 0, i) for i in range(len(trees))]


def random_shape(rng: random.Random, vocab: int, with_probs: bool) -> TokenTree:
    """A tree of 0-9 nodes, siblings' tokens distinct, some nodes with the draft distribution of their children."""
    tokens, parents = [], []
    for i in range(rng.randint(0, 9)):
        parent = rng.randint(-1, i - 1)
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(vocab) if t not in taken]
        if not free:
            break
        tokens.append(rng.choice(free))
        parents.append(parent)
    probs = {}
    if with_probs:
        for node in [-1, *range(len(tokens))]:
            if rng.random() < 0.6:
                probs[node] = torch.softmax(torch.randn(vocab), -1)
    return TokenTree(tokens, parents, [0.5] * len(tokens), probs)


def test_where_the_target_leaves_no_chance_each_tree_walks_as_the_rule_alone():
    """One-hot targets: every trial and every residual draw is certain, so each tree of a batch (depths 0-9,
    branching up to 9, with and without draft distributions) gives exactly the rule's tokens alone."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(0)
    vocab, depths = 7, []

    def target_of(tree: TokenTree, node: int) -> int:  # mostly one of the node's children: walks go down
        children = tree.children(node)
        return tree.tokens[rng.choice(children)] if children and rng.random() < 0.7 else rng.randrange(vocab)
    for _ in range(40):
        trees = [random_shape(rng, vocab, rng.random() < 0.5) for _ in range(rng.randint(1, 12))]
        probs = [torch.nn.functional.one_hot(torch.tensor([target_of(t, node) for node in range(-1, len(t))]),
                                             vocab).float() for t in trees]
        got = walked(trees, probs, gen)
        assert got == [accept_tree_sampled(p, t, gen) for p, t in zip(probs, trees)]
        depths += [len(tokens) - 1 for tokens in got]
    assert max(depths) >= 3 and depths.count(0) < len(depths) / 2  # walks went deep, and most went down


def test_trees_walked_together_follow_the_target():
    """test_rejection_sampler's target and poor draft: three root children drawn from the draft, two grandchildren
    each; 12,000 trees in batches of 60 beside trees of other shapes (a deterministic chain, a lone root)."""
    gen = torch.Generator().manual_seed(0)
    n, counts = 12000, np.zeros(V * V)
    chain = TokenTree([2, 0, 4], [-1, 0, 1], [0.5] * 3)  # no child_probs: fixed tokens
    chain_rows = torch.stack([P_ROOT, _p_next(2), P_ROOT, P_ROOT])
    lone = TokenTree([], [], [])
    for _ in range(n // 60):
        made = [_random_tree(gen) for _ in range(60)]
        trees = [t for t, _ in made] + [chain, lone]
        probs = [torch.softmax(logits, -1) for _, logits in made] + [chain_rows, P_ROOT[None]]
        for i, out in enumerate(walked(trees, probs, gen)):
            if len(out) < 2:  # the first token was drawn from the residual: the second from the target
                out.append(int(torch.multinomial(_p_next(out[0]), 1, generator=gen)))
            counts[out[0] * V + out[1]] += i < 60
    expected = np.array([float(P_ROOT[x] * _p_next(x)[y]) for x in range(V) for y in range(V)]) * n
    assert _chi2_pvalue(counts, expected) > 1e-4  # a false alarm 1 time in 10,000


def test_a_step_with_sampled_trees_reads_the_host_once(monkeypatch):
    """The accept stage walks its unseeded sampled trees with the others' verdicts: one host read for the step,
    each tree's tokens a walk down its own tree."""
    g = torch.Generator().manual_seed(1)
    vocab = 16
    reads, original = [], torch.Tensor.tolist

    def counted(self):
        reads.append(tuple(self.shape))
        return original(self)
    items, drafts = [], {}
    for i in range(3):
        tree = TokenTree([1, 2, 3, 4], [-1, -1, 0, 2], [0.5] * 4, {-1: torch.softmax(torch.randn(vocab), -1)})
        request = Request(f"t{i}", [5, 6, 7], SamplingParams(temperature=0.9, top_k=8))
        request.generator = g
        items.append(ForwardItem(request, [7] + tree.tokens, 3, 1 + len(tree)))
        drafts[request.request_id] = Draft(tree.tokens, None, tree)
    logits = torch.randn(15, vocab, generator=g)
    logits[:, 1] += 4.0  # the root's first child, and its descendants, often accepted
    logits[1:, 3] += 4.0
    logits[3:, 4] += 4.0
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with Copies(monkeypatch) as syncs:
        out = accept_drafts(items, logits, drafts).tokens
    assert len(reads) == 1 and syncs.seen == [] and syncs.copies == 1
    for rid, tokens in out.items():
        tree = drafts[rid].tree
        assert 1 <= len(tokens) <= 4 and len(tree.follow(tokens[:-1])) == len(tokens) - 1
    assert any(len(tokens) > 1 for tokens in out.values())
