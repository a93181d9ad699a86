"""The sampled acceptance rule reproduces the target distribution exactly (chi-square), and a known-wrong rule
(one that ignores the draft's probabilities) is caught by the same test; the same for token trees
(recursive rejection sampling)."""
import math

import numpy as np
import pytest
import torch
from chi_square import CHI2_CRIT, chi2

from smartspec import SamplingParams
from smartspec.runtime.sampler import target_probs
from smartspec.spec_decode.rejection_sampler import accept_greedy, accept_sampled, accept_tree, accept_tree_greedy
from smartspec.types.tree import TokenTree

V, K, N = 8, 3, 12000
def run(params: SamplingParams, sampler, seed: int = 0, draft_vocab: int | None = None):
    """draft_vocab < V: the draft's vocabulary is the first draft_vocab tokens, q padded with zeros beyond (as
    DraftModelProposer pads a draft whose vocabulary is shorter than the target's)."""
    draft_vocab = V if draft_vocab is None else draft_vocab
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(K, V, generator=g) * 1.5
    p = target_probs(target_logits, params)
    q = torch.nn.functional.pad(target_probs(draft_logits[:, :draft_vocab], params), (0, V - draft_vocab))
    by_index = [[] for _ in range(K + 1)]
    for _ in range(N):
        draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(K)]
        for j, tok in enumerate(sampler(p, draft, q, g)):
            by_index[j].append(tok)
    # given the first j tokens of a step, token j must follow the target's distribution at position j
    return [chi2(s, p[j]) for j, s in enumerate(by_index) if len(s) > 500], [len(s) for s in by_index]


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-topk5", "t1.3-topp0.8"])
def test_sampled_acceptance_follows_target_distribution(params):
    stats, counts = run(params, accept_sampled)
    assert len(stats) >= 3, counts  # positions 0.. K - 1 reached often enough to test
    assert max(stats) < CHI2_CRIT, (stats, counts)


def test_a_draft_with_a_shorter_vocabulary_still_gives_the_target_distribution():
    # tokens past the draft's vocabulary are never drafted, only reached through rejections
    stats, counts = run(PARAMS[0], accept_sampled, draft_vocab=V // 2)
    assert len(stats) >= 2, counts  # fewer drafts accepted: positions 0 and 1 reached often enough
    assert max(stats) < CHI2_CRIT, (stats, counts)


def test_one_hot_proposal_rule_is_also_exact():
    # Treating a drawn token as a deterministic proposal (accept with p(x), else resample p without x) is exact
    # too: P(y) = q(y) p(y) + p(y) sum_{x != y} q(x) = p(y). It is the rule prompt lookup uses.
    stats, _ = run(PARAMS[0], lambda p, draft, q, g: accept_sampled(p, draft, None, g))
    assert max(stats) < CHI2_CRIT


def resample_from_p_on_reject(p, draft, q, g):
    """A known-wrong rule: correct acceptance test, but a rejection resamples from p instead of
    norm(max(p - q, 0)), which over-weights the tokens the draft over-proposes."""
    out = []
    for j, tok in enumerate(draft):
        if float(torch.rand((), generator=g)) * float(q[j, tok]) < float(p[j, tok]):
            out.append(tok)
            continue
        out.append(int(torch.multinomial(p[j], 1, generator=g)))
        return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=g)))
    return out


def test_a_known_wrong_sampler_fails_the_same_test():
    stats, _ = run(PARAMS[0], resample_from_p_on_reject)
    assert max(stats) > 3 * CHI2_CRIT, stats


def test_greedy_acceptance():
    logits = torch.zeros(4, 10)
    for j, t in enumerate([3, 5, 7, 2]):
        logits[j, t] = 1.0
    assert accept_greedy(logits, [3, 5, 7]) == [3, 5, 7, 2]  # all accepted + bonus
    assert accept_greedy(logits, [3, 6, 7]) == [3, 5]  # first mismatch replaced by the target's token
    assert accept_greedy(logits[:1], []) == [3]


# ---- token trees: recursive rejection sampling ----

V = 6
P_ROOT = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q_ROOT = torch.tensor([0.05, 0.10, 0.40, 0.25, 0.15, 0.05])  # a poor draft: its mass is where the target's is not


def _p_next(x: int) -> torch.Tensor:
    return torch.roll(P_ROOT, x)


def _q_next(x: int) -> torch.Tensor:
    return torch.roll(Q_ROOT, 2 * x)


def _draw(q: torch.Tensor, n: int, gen: torch.Generator) -> list[int]:
    keys = q.log() - (-torch.rand(q.shape, generator=gen).log()).log()  # Gumbel top-n: without replacement
    return torch.topk(keys, n).indices.tolist()


def _random_tree(gen):
    """Three root children drawn without replacement from Q_ROOT, two grandchildren under each."""
    tokens, parents, probs = [], [], {-1: Q_ROOT}
    for x in _draw(Q_ROOT, 3, gen):
        tokens.append(x)
        parents.append(-1)
    for c in range(3):
        probs[c] = _q_next(tokens[c])
        for y in _draw(probs[c], 2, gen):
            tokens.append(y)
            parents.append(c)
    tree = TokenTree(tokens, parents, [0.5] * len(tokens), probs)
    rows = [P_ROOT] + [_p_next(tokens[i]) if parents[i] < 0 else P_ROOT for i in range(len(tokens))]
    return tree, torch.stack(rows).log()


def _wrong_accept(logits, tree, params, gen):
    """Tries every sibling against the full target instead of the residual left by the rejected ones."""
    p = torch.softmax(logits, -1)
    out, node = [], -1
    while True:
        q, kids = tree.child_probs.get(node), tree.children(node)
        if not kids:
            out.append(int(torch.multinomial(p[node + 1], 1, generator=gen)))
            return out
        for child in kids:
            tok = tree.tokens[child]
            if float(torch.rand((), generator=gen)) * float(q[tok]) < float(p[node + 1][tok]):
                out.append(tok)
                node = child
                break
        else:
            out.append(int(torch.multinomial(torch.clamp(p[node + 1] - q, min=0) + 1e-12, 1, generator=gen)))
            return out


def _chi2_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = len(counts) - 1  # Wilson-Hilferty: chi2(k) ~ k (1 - 2/9k + z sqrt(2/9k))^3
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("sampler,should_pass", [(accept_tree, True), (_wrong_accept, False)])
def test_recursive_rejection_sampling_follows_the_target(sampler, should_pass):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    n = 12000
    counts = np.zeros(V * V)
    for _ in range(n):
        tree, logits = _random_tree(gen)
        out = sampler(logits, tree, params, gen)
        if len(out) < 2:  # the first token was resampled: draw the second from the target, as the next step would
            out.append(int(torch.multinomial(_p_next(out[0]), 1, generator=gen)))
        counts[out[0] * V + out[1]] += 1
    expected = np.array([float(P_ROOT[x] * _p_next(x)[y]) for x in range(V) for y in range(V)]) * n
    p_value = _chi2_pvalue(counts, expected)
    assert (p_value > 1e-4) == should_pass, p_value  # a false alarm 1 time in 10,000


def test_recursive_rejection_sampling_with_fixed_siblings_follows_the_target():
    """Prompt-lookup trees under sampling: deterministic siblings (q one-hot at each), tried in order."""
    gen = torch.Generator().manual_seed(1)
    tree = TokenTree([2, 0, 4, 1, 5, 3], [-1, -1, -1, 0, 0, 1], [0.5] * 6)  # no child_probs: fixed tokens
    rows = [P_ROOT] + [_p_next(tree.tokens[i]) if tree.parents[i] < 0 else P_ROOT for i in range(len(tree))]
    logits = torch.stack(rows).log()
    n = 12000
    counts = np.zeros(V * V)
    for _ in range(n):
        out = accept_tree(logits, tree, SamplingParams(temperature=1.0), gen)
        if len(out) < 2:
            out.append(int(torch.multinomial(_p_next(out[0]), 1, generator=gen)))
        counts[out[0] * V + out[1]] += 1
    expected = np.array([float(P_ROOT[x] * _p_next(x)[y]) for x in range(V) for y in range(V)]) * n
    assert _chi2_pvalue(counts, expected) > 1e-4


def test_greedy_tree_acceptance_walks_the_argmax_path():
    tree = TokenTree([1, 2, 3, 4], [-1, -1, 1, 1], [0.5] * 4)
    logits = torch.full((5, V), -5.0)
    for row, tok in ((0, 2), (2, 4), (4, 5)):  # after root: 2 (node 1), after node 1: 4 (node 3), then 5
        logits[row, tok] = 5.0
    assert accept_tree_greedy(logits, tree) == [2, 4, 5]


# ---- goodput for trees ----------------------------------------------------------------------------------------------
