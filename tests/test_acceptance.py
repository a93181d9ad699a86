"""Acceptance estimation: per-request decayed counts shrunk toward a learned per-proposer prior."""
import math
import random

import numpy as np
import pytest
from costs import linear_cost
from policy_views import view

from smartspec import SamplingParams
from smartspec.policy import GoodputPolicy
from smartspec.policy.acceptance import AcceptanceEstimator, ChainAcceptance, EstimatorSettings, log_gamma
from smartspec.policy.goodput import chain_gains, select_from_gains
from smartspec.types.request import Request


def geometric_accepted(rng, alpha, k):
    a = 0
    while a < k and rng.random() < alpha:
        a += 1
    return a


# ---- acceptance ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.9])
def test_estimator_converges_on_bernoulli_streams(alpha):
    rng = random.Random(0)
    est = AcceptanceEstimator(prior_alpha=0.5)
    per_request = []
    for step in range(400):
        rids = [f"r{i}" for i in range(8)]
        est.tick()
        for rid in rids:
            est.observe(rid, 4, geometric_accepted(rng, alpha, 4))
        if step >= 100:
            per_request.append(est.alpha("r0"))
    assert abs(est.prior - alpha) < 0.04, est.prior
    assert abs(sum(per_request) / len(per_request) - alpha) < 0.06


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_chain_stages_agree_when_every_depth_is_equally_hard(alpha):
    """A draft model's acceptance: the same rate at every depth. Both stages find it, and the chain's gains are the
    single-rate model's alpha^j."""
    rng = random.Random(3)
    chain = ChainAcceptance(prior_alpha=0.5)
    for _ in range(400):
        chain.tick()
        for rid in ("r0", "r1"):
            chain.observe(rid, 5, geometric_accepted(rng, alpha, 5))
    # the later stage hears only from drafts whose first token was accepted: fewer outcomes, more noise at low alpha
    assert chain.first.prior == pytest.approx(alpha, abs=0.05) and chain.later.prior == pytest.approx(alpha, abs=0.1)
    assert chain.gains(["x"], 5)[0] == pytest.approx(alpha ** np.arange(1, 6), abs=0.08)


def test_a_first_token_miss_lowers_every_depth_alike():
    """Prompt lookup: the first token is accepted 85% of the time, a later one always after an accepted predecessor.
    A new request whose first draft missed keeps a flat gains curve, so at batch 5 on this machine's step cost it
    drafts the whole chain or nothing, never the 1-2 tokens the single-rate model chose."""
    rng = random.Random(4)
    chain, single = ChainAcceptance(prior_alpha=0.5), AcceptanceEstimator(prior_alpha=0.5)
    for i in range(60):
        a = 5 if rng.random() < 0.85 else 0
        for est in (chain, single):
            est.observe(f"old{i % 6}", 5, a)
    for est in (chain, single):
        est.observe("new", 5, 0)
    ids = ["new"] + [f"old{i}" for i in range(4)]
    cost = linear_cost(0.3, 0.024)  # about what batch 5 cost on the CPU: 24 ms a token
    chain_ks, _ = select_from_gains(chain.gains(ids, 5), [5] * 5, np.arange(1, 6), cost, 5, 5000)
    gains = chain_gains([single.alpha(r) for r in ids], 5)
    single_ks, _ = select_from_gains(gains, [5] * 5, np.arange(1, 6), cost, 5, 5000)
    assert chain_ks[0] in (0, 5) and chain_ks[1:] == [5] * 4, chain_ks
    assert 0 < single_ks[0] < 5, single_ks  # what the single rate did: a short chain for the request that missed
    curve = chain.gains(["new"], 5)[0]
    assert curve[-1] / curve[0] > 0.9


def test_later_tokens_never_tried_are_guessed_like_first_ones():
    """At k = 1 the later stage hears nothing; it must not hold the policy at k = 1 with a pessimistic guess."""
    chain = ChainAcceptance(prior_alpha=0.5)
    for i in range(40):
        chain.observe(f"r{i % 4}", 1, 1)
    assert chain.later.evidence == 0 and chain.first.prior > 0.9
    # guessed like first tokens (the single-rate model): deep drafts worth almost as much as the first
    assert chain.later.prior == pytest.approx(chain.first.prior) and chain.gains(["r0"], 5)[0, -1] > 0.75
    policy = GoodputPolicy(key="draft")
    policy.cost.v = [0.3] + [0.001] * 6 + [0.0]
    policy.cost.d = [0.01, 0.001, 0.0]
    for i in range(40):
        policy.acceptance.observe(f"r{i % 4}", 1, 1)
    ks = policy.plan(view([Request(f"r{i}", list(range(50)), SamplingParams(max_tokens=64)) for i in range(4)], 5)).ks
    assert min(ks) > 1, ks


def test_request_without_evidence_drifts_to_the_prior():
    est = AcceptanceEstimator(prior_alpha=0.5)
    for _ in range(50):  # the prior learns from other requests: about 0.8
        est.observe("other", 4, 4)
        est.observe("other", 4, 2)
    for _ in range(20):
        est.observe("bad", 4, 0)
    assert est.alpha("bad") < 0.3
    for _ in range(100):  # "bad" runs at k = 0: no evidence, only time
        est.tick()
    assert abs(est.alpha("bad") - est.prior) < 0.02 and est.prior > 0.6


def test_prior_strength_is_learned_from_how_much_finished_requests_differ():
    rng = random.Random(2)

    def finished(alphas):
        est = AcceptanceEstimator(prior_alpha=0.5)
        for i, alpha in enumerate(alphas):
            for _ in range(12):
                est.observe(f"r{i}", 4, geometric_accepted(rng, alpha, 4))
            est.forget(f"r{i}")
        return est

    assert finished([0.9] * 7).prior_strength == pytest.approx(16.0)  # too few finished: not learned (range middle)
    alike, mixed = finished([0.9] * 32), finished([0.3, 0.95] * 16)
    assert alike.prior_strength >= 32 and mixed.prior_strength <= 8, (alike.prior_strength, mixed.prior_strength)
    # one early rejection barely moves a new request when requests are alike, and moves it a lot when they differ
    for est in (alike, mixed):
        est.observe("new", 4, 0)
    assert alike.prior - alike.alpha("new") < 0.03
    assert mixed.prior - mixed.alpha("new") > 0.1


def test_log_gamma_matches_the_standard_library():
    xs = np.geomspace(1e-3, 5000, 400)
    assert np.abs(log_gamma(xs) - np.array([math.lgamma(x) for x in xs])).max() < 1e-8


def test_a_cold_estimator_trusts_a_new_requests_outcomes_as_they_accumulate():
    """Before any request finished: one rejected first draft barely moves a request (prompt lookup often misses on
    an answer's first tokens), a run of rejections moves it as far as the weakest prior would."""
    cold, weak, strong = (AcceptanceEstimator(prior_alpha=0.5, settings=EstimatorSettings(prior_strength=s))
                          for s in (None, 4.0, 64.0))
    for est in (cold, weak, strong):
        for _ in range(50):  # other requests: 0.9
            est.observe("other", 5, 5)
            est.observe("other", 5, 4)
        est.observe("new", 5, 0)
    assert cold.prior == pytest.approx(weak.prior)
    one = [est.prior - est.alpha("new") for est in (cold, weak, strong)]
    assert one[0] < 0.1 < one[1] and one[0] < 2 * one[2] + 0.05, one
    for est in (cold, weak, strong):
        for _ in range(9):
            est.observe("new", 5, 0)
    ten = [est.alpha("new") for est in (cold, weak, strong)]
    assert ten[0] < ten[1] + 0.05 and ten[0] < 0.4 < ten[2], ten


def test_a_requests_estimate_does_not_depend_on_the_rest_of_its_batch():
    """The cold estimator computes requests without outcomes once per prior and the others row by row: each
    request's estimate must be the very float it gets alone, whichever requests share its batch."""
    est = AcceptanceEstimator(prior_alpha=0.6)
    rng = random.Random(3)
    for i in range(6):
        if i % 2:
            for _ in range(rng.randint(1, 4)):
                est.observe(f"r{i}", 4, rng.randint(0, 4))
    ids = [f"r{i}" for i in range(6)] + ["never-seen"]
    batch = est.alphas(ids)
    alone = [est.alphas([r])[0] for r in ids]
    assert np.array_equal(batch, np.array(alone))
    assert batch[0] == batch[-1] and len(set(batch[1:6:2].tolist())) > 1  # unseen alike; seen their own


def test_estimates_are_the_same_floats_in_any_batch_on_this_cpu():
    """Hundreds of requests of every outcome count, cold: each request's estimate in the batch is the float it
    gets alone (the one-request path takes numpy's log and exp as the batch's does: on AVX-512 CPUs numpy's and
    libm's differ in the last bit of some values)."""
    est = AcceptanceEstimator(prior_alpha=0.7)
    rng = random.Random(11)
    ids = [f"r{i}" for i in range(400)]
    for rid in ids:
        for _ in range(rng.randint(1, 12)):
            est.observe(rid, 5, rng.randint(0, 5))
        est.tick()
    batch = est.alphas(ids)
    alone = np.array([est.alphas([rid])[0] for rid in ids])
    assert np.array_equal(batch, alone), np.flatnonzero(batch != alone)[:10]


# ---- cost model ------------------------------------------------------------------------------------------------


def test_a_step_of_outcomes_counts_as_its_outcomes_one_at_a_time():
    """observe_many (a step's outcomes at once, the prior's decayed sums in one array operation) leaves every
    count where one observe per outcome leaves it; decay is read lazily, by the steps passed since a request's last
    outcome, as if applied at every tick."""
    rng = random.Random(5)
    one, many = AcceptanceEstimator(prior_alpha=0.5), AcceptanceEstimator(prior_alpha=0.5)
    for step in range(60):
        one.tick()
        many.tick()
        rids = [f"r{i}" for i in range(12) if rng.random() < 0.7]
        proposed = [rng.randint(1, 5) for _ in rids]
        accepted = [rng.randint(0, p) for p in proposed]
        for rid, p, a in zip(rids, proposed, accepted):
            one.observe(rid, p, a)
        many.observe_many(rids, np.array(proposed), np.array(accepted))
    ids = [f"r{i}" for i in range(12)]
    assert many.prior_counts.accepted == pytest.approx(one.prior_counts.accepted, rel=1e-12)
    assert many.prior_counts.rejected == pytest.approx(one.prior_counts.rejected, rel=1e-12)
    assert many.alphas(ids) == pytest.approx(one.alphas(ids), rel=1e-12)
    manual = AcceptanceEstimator(prior_alpha=0.5, settings=EstimatorSettings(request_decay=0.5))
    manual.observe("x", 4, 4)
    for _ in range(3):
        manual.tick()
    a, r, at = manual.counts("x")
    assert (a * 0.5 ** (manual.clock - at), r) == (0.5, 0.0)


def test_a_small_batch_estimates_in_python_floats_as_a_large_one_in_arrays():
    """A cold estimator answers a batch of at most SCALAR_ROWS requests in Python floats and a larger one in numpy
    arrays: the same estimates either way, to rounding."""
    from smartspec.policy.acceptance import SCALAR_ROWS, AcceptanceEstimator

    rng = np.random.default_rng(8)
    est = AcceptanceEstimator(prior_alpha=0.6)
    ids = [f"r{i}" for i in range(12)]
    for _ in range(30):
        for rid in ids[:9]:  # three requests keep no outcomes
            k = int(rng.integers(1, 6))
            est.observe(rid, k, int(rng.integers(0, k + 1)))
        est.tick()
    whole = est.alphas(ids)
    alone = np.concatenate([est.alphas(ids[i:i + SCALAR_ROWS]) for i in range(0, len(ids), SCALAR_ROWS)])
    assert np.abs(whole - alone).max() < 1e-12
    assert len(set(whole.round(12))) > 3  # requests differ: the check compares something
