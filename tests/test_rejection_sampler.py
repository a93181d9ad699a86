"""The sampled acceptance rule reproduces the target distribution exactly (chi-square), and a known-wrong rule
(one that ignores the draft's probabilities) is caught by the same test."""
import pytest
import torch

from smartspec.engine.sampler import target_probs
from smartspec.sampling_params import SamplingParams
from smartspec.spec.rejection_sampler import accept_greedy, accept_sampled

V, K, N = 8, 3, 12000
# chi-square critical values at alpha = 1e-4, by degrees of freedom (support size - 1)
CHI2_CRIT_BY_DOF = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
CHI2_CRIT = CHI2_CRIT_BY_DOF[7]


def chi2(samples: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=V).double()
    expected = p.double() * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a token the target gives probability 0"
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat / CHI2_CRIT_BY_DOF[int(keep.sum()) - 1] * CHI2_CRIT  # scaled so one threshold fits every support


def run(params: SamplingParams, sampler, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(K, V, generator=g) * 1.5
    p, q = target_probs(target_logits, params), target_probs(draft_logits, params)
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
