import itertools
import math
import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from smartspec import LLM, SamplingParams
from smartspec.engine.request import Request
from smartspec.policy import BatchTablePolicy, SmartSpecPolicy, make_policy, merge_states
from smartspec.policy.acceptance import AcceptanceEstimator, ChainAcceptance, log_gamma
from smartspec.policy.arrivals import ArrivalGaps
from smartspec.policy.base import StepRecord
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import (chain_gains, charge_start_costs, expected_tokens, goodput, select_from_gains,
                                      select_k)


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
        est.tick(rids)
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
        chain.tick(["r0", "r1"])
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
    policy = SmartSpecPolicy(key="draft")
    policy.cost.v = [0.3] + [0.001] * 6 + [0.0]
    policy.cost.d = [0.01, 0.001, 0.0]
    for i in range(40):
        policy.acceptance.observe(f"r{i % 4}", 1, 1)
    ks = policy.choose([Request(f"r{i}", list(range(50)), SamplingParams(max_tokens=64)) for i in range(4)], 5)
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
        est.tick(["bad"])
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
    cold, weak, strong = (AcceptanceEstimator(prior_alpha=0.5, prior_strength=s) for s in (None, 4.0, 64.0))
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


# ---- cost model ------------------------------------------------------------------------------------------------
def true_verify(n, c):
    return 0.05 + 0.002 * n + 1e-5 * c + 0.004 * max(0, n - 16)


def test_cost_model_recovers_known_coefficients_from_noisy_timings():
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(300):
        n, c = rng.randint(1, 64), rng.randint(100, 2000)
        depth = rng.randint(0, 5)
        sum_k = depth * rng.randint(1, 4) if depth else 0
        draft = 0.02 * depth + 0.003 * sum_k
        model.observe(n, c, depth, sum_k, draft * rng.uniform(0.98, 1.02), true_verify(n, c) * rng.uniform(0.98, 1.02))
    for n in (1, 4, 8, 16, 24, 48, 64):
        for c in (200, 1500):
            assert model.predict_verify(n, c) == pytest.approx(true_verify(n, c), rel=0.03)
    assert model.d[:2] == pytest.approx([0.02, 0.003], rel=0.05) and model.d[2] == pytest.approx(0, abs=1e-4)


def test_cost_model_refuses_nonsense_and_keeps_the_last_good_fit():
    model = StepCostModel(window=16)
    for n in (1, 2, 4, 8, 12, 16):
        model.observe(n, 100, 0, 0, 0.0, true_verify(n, 100))
    good = list(model.v)
    for n in (1, 2, 4, 8, 12, 16, 20, 24) * 2:  # a broken clock: no positive base cost fits these
        model.observe(n, 100, 0, 0, 0.0, -0.5)
    assert model.v == pytest.approx(good, rel=1e-6) and model.refused > 0
    assert model.predict_verify(8, 100) == pytest.approx(true_verify(8, 100), rel=0.01)


def test_cost_model_stays_a_cost_whatever_it_is_fed():
    model = StepCostModel()
    for n in (1, 2, 4, 8, 12, 16, 20, 24, 100, 200):  # timings that fall with more tokens
        model.observe(n, 100 + n, 0, 0, 0.0, 1.0 - 0.004 * n)
    grid = [model.predict_verify(n, 1000) for n in range(1, 400)]
    assert grid[0] > 0 and all(b >= a for a, b in zip(grid, grid[1:]))


def test_cost_model_reports_prediction_error_on_the_shape_that_ran():
    model = StepCostModel()
    for n in (1, 2, 4, 8, 1, 2, 4, 8):
        model.observe(n, 100, 0, 0, 0.0, 0.1 + 0.01 * n)
    assert model.mean_relative_error < 1e-6  # the fit is exact for these shapes
    model.observe(4, 100, 0, 0, 0.0, 1.1 * (0.1 + 0.01 * 4))
    assert model.errors[-1] == pytest.approx(0.1 / 1.1, rel=1e-3)


def stalled_steps(model, steps, rng, stall_rate, speed=1.0):
    """One request at a time at k = 5 (prompt lookup now and then finds fewer tokens), a step stalled 2-8x now and
    then, as on a shared machine."""
    for i in range(steps):
        n = 6 if rng.random() > 0.2 else rng.randint(1, 5)
        c = 200 + (7 * i) % 400
        t = speed * true_verify(n, c) * rng.uniform(0.97, 1.05)
        if rng.random() < stall_rate:
            t *= rng.uniform(2, 8)
        model.observe(n, c, 0, 0, 0.0, t)


def test_cost_model_leaves_stalled_steps_out_of_the_fit():
    fits = {}
    for cut in (0.0, 3.5):  # 0: plain least squares, the fit before stalls were left out
        model = StepCostModel(outlier_cut=cut)
        stalled_steps(model, 300, random.Random(0), stall_rate=0.08)
        fits[cut] = [model.predict_verify(n, 400) / true_verify(n, 400) for n in range(1, 9)]
    assert all(r == pytest.approx(1.0, abs=0.06) for r in fits[3.5])
    # what plain least squares made of the same steps: the level and the slope over n both bent by the stalls
    assert max(abs(r - 1) for r in fits[0.0]) > 0.15


def test_cost_model_follows_a_sustained_change_of_speed():
    rng = random.Random(2)
    model = StepCostModel()
    stalled_steps(model, 200, rng, stall_rate=0.05)
    stalled_steps(model, 150, rng, stall_rate=0.05, speed=1.4)  # the machine got slower and stayed slower
    for n in (1, 3, 6, 8):
        assert model.predict_verify(n, 400) == pytest.approx(1.4 * true_verify(n, 400), rel=0.06)


def context_free_verify(n, c):
    return 0.1 + 0.01 * n


def profiled_policy(prior_weight):
    """A policy whose cost model saw the engine's warm-up profile (batch 1 and 4 at 64 tokens of context each, k
    0/1/2/5), timed by context_free_verify."""
    policy = SmartSpecPolicy(key="t")
    policy.cost.prior_weight = prior_weight
    records = [StepRecord(0, b, [k] * b, [k] * b, [0] * b, [], b * (k + 1), 0, 64 * b + j, 0.0,
                          context_free_verify(b * (k + 1), 64 * b), context_free_verify(b * (k + 1), 64 * b))
               for b in (1, 4) for k in (0, 1, 2, 5) for j in range(2)]
    policy.observe_profile(records)
    return policy


def test_the_profile_decides_the_split_the_running_data_cannot():
    """Steps in which context grows exactly with the batched tokens (50 a token) fit any split of their cost
    between the two; the profile measured them apart, so the fit keeps its split (context free) and prices a shape
    with less context right."""
    fits = {}
    for weight in (0.0, 4.0):  # 0: no prior, the fit before the profile was kept
        policy = profiled_policy(weight)
        for i in range(300):
            n = 2 + 2 * (i % 4)
            policy.cost.observe(n, 50 * n, 0, 0, 0.0, context_free_verify(n, 50 * n))
        fits[weight] = policy.cost
    for n in (2, 8):  # where the data was, both fits are right
        assert fits[0.0].predict_verify(n, 50 * n) == pytest.approx(context_free_verify(n, 0), rel=0.01)
        assert fits[4.0].predict_verify(n, 50 * n) == pytest.approx(context_free_verify(n, 0), rel=0.01)
    assert fits[4.0].predict_verify(8, 0) == pytest.approx(context_free_verify(8, 0), rel=0.03)
    assert fits[4.0].predict_verify(8, 2000) == pytest.approx(context_free_verify(8, 0), rel=0.03)
    assert fits[0.0].predict_verify(8, 2000) > 1.3 * context_free_verify(8, 0)  # without it: an arbitrary split


def test_the_fit_follows_the_data_away_from_the_profile():
    """The machine slowed by 40% after the profile and context turned out to cost: where the data tells, the data
    decides, not the profile."""
    def slower(n, c):
        return 1.4 * context_free_verify(n, c) + 2e-4 * c

    policy = profiled_policy(4.0)  # the default weight
    shapes = ((1, 100), (6, 1500), (16, 400), (30, 1000))
    assert all(policy.cost.predict_verify(n, c) < 0.7 * slower(n, c) for n, c in shapes)
    rng = random.Random(3)
    for _ in range(300):
        n, c = rng.randint(1, 30), rng.randint(100, 1500)
        policy.cost.observe(n, c, 0, 0, 0.0, slower(n, c))
    for n, c in shapes:
        assert policy.cost.predict_verify(n, c) == pytest.approx(slower(n, c), rel=0.06)


# ---- selection -------------------------------------------------------------------------------------------------
def linear_cost(v0, v1, d0=0.0, d1=0.0):
    """n counts every token of the step: the decodes and the drafts."""
    return lambda n, c, depth, sum_k: v0 + v1 * n + d0 * depth + d1 * sum_k


def test_steep_verification_or_low_alpha_means_no_speculation():
    ks, _ = select_k([0.9] * 4, [5] * 4, linear_cost(0.0, 0.1), 4, 400)  # compute-bound: cost per token
    assert ks == [0, 0, 0, 0]
    ks, _ = select_k([0.05] * 4, [5] * 4, linear_cost(0.1, 0.002), 4, 400)
    assert ks == [0, 0, 0, 0]


def test_cheap_verification_and_high_alpha_speculate():
    ks, t = select_k([0.9] * 4, [5] * 4, linear_cost(0.1, 0.001), 4, 400)
    assert all(k >= 3 for k in ks)
    assert t == pytest.approx(0.1 + 0.001 * (4 + sum(ks)))


def test_mixed_alpha_gives_longer_drafts_to_better_accepted_requests():
    ks, _ = select_k([0.95, 0.5, 0.2, 0.75], [6] * 4, linear_cost(0.1, 0.004, d0=0.002), 4, 400)
    assert ks[0] >= ks[3] >= ks[1] >= ks[2] and ks[0] > ks[2]


def test_caps_are_respected():
    ks, _ = select_k([0.99] * 3, [0, 2, 5], linear_cost(0.1, 0.0001), 3, 400)
    assert ks[0] == 0 and ks[1] <= 2 and ks[2] <= 5


def test_greedy_is_within_a_few_percent_of_brute_force():
    rng = random.Random(3)
    worst = 1.0
    for _ in range(300):
        b, k_max = rng.randint(1, 4), 4
        alphas = [rng.uniform(0.05, 0.98) for _ in range(b)]
        cost = linear_cost(rng.uniform(0.02, 0.3), rng.uniform(0.0, 0.05), rng.uniform(0, 0.05), rng.uniform(0, 0.02))
        ks, t = select_k(alphas, [k_max] * b, cost, b, 0)  # k = 0: b decode tokens
        mine = goodput(ks, alphas, t)

        def gp(combo):
            return goodput(list(combo), alphas, cost(b + sum(combo), sum(combo), max(combo), sum(combo)))

        best = max(gp(c) for c in itertools.product(range(k_max + 1), repeat=b))
        assert mine >= gp([0] * b) - 1e-12  # never worse than not speculating
        worst = min(worst, mine / best)
    assert worst > 0.97, worst


def test_priced_selection_is_the_exact_optimum_of_tokens_minus_price_times_time():
    rng = random.Random(4)
    for _ in range(200):
        b, k_max = rng.randint(1, 3), 4
        alphas = [rng.uniform(0.05, 0.98) for _ in range(b)]
        cost = linear_cost(rng.uniform(0.02, 0.3), rng.uniform(0.0, 0.05), rng.uniform(0, 0.05), rng.uniform(0, 0.02))
        base, price = rng.randint(0, 200), rng.uniform(1, 80)
        ks, _ = select_from_gains(chain_gains(alphas, k_max), [k_max] * b, np.arange(1, k_max + 1), cost, b + base,
                                  base, price)

        def value(combo):
            t = cost(b + base + sum(combo), base + sum(combo), max(combo), sum(combo))
            return sum(expected_tokens(k, a) for k, a in zip(combo, alphas)) - price * t

        best = max(value(c) for c in itertools.product(range(k_max + 1), repeat=b))
        assert value(ks) >= best - 1e-9


def seen_verify(n, c):
    """What a policy that always drafted 5 tokens could have learned: tokens cheap, context dear."""
    return 0.10 + 0.005 * n + 0.0008 * c


def runs_verify(n, c):
    """What the steps cost: context free, tokens beyond 16 twice as dear. Equal to seen_verify at 5-token drafts for
    four requests of 110 tokens (24 tokens, 440 context), so running only those shapes cannot tell them apart."""
    return 0.092 + 0.015 * min(n, 16) + 0.03 * max(0, n - 16)


def draft_cost(depth, sum_k):
    return 0.06 * depth + 0.007 * sum_k


def run_fully_accepted_batch(policy, steps, b=4):
    """b requests whose drafts are always accepted, each step costed by runs_verify; the ks of each step."""
    requests = [Request(f"r{i}", list(range(105)), SamplingParams(max_tokens=10_000)) for i in range(b)]
    for r in requests:
        for _ in range(20):
            policy.acceptance.observe(r.request_id, 5, 5)
    chosen = []
    for step in range(steps):
        ks = policy.choose(requests, 5)
        n, c, depth = b + sum(ks), sum(r.num_tokens for r in requests) + sum(ks), max(ks)
        verify, drafting = runs_verify(n, c), draft_cost(depth, sum(ks))
        policy.observe(StepRecord(step, b, ks, ks, ks, [r.request_id for r in requests], n, 0, c, drafting, verify,
                                  verify + drafting))
        chosen.append(ks)
    return chosen


def test_cost_model_keeps_steps_that_ran_faster_than_its_fit():
    """A stall makes a step slower, never faster: a step far below the fit is a shape the fit has wrong, and left
    out as an outlier (as the fit did before), it could never be corrected."""
    model = StepCostModel()
    for _ in range(20):
        for b in range(1, 6):
            model.observe(6 * b, 110 * b, 0, 0, 0.0, seen_verify(6 * b, 110 * b))
    assert model.predict_verify(12, 440) > 1.4 * runs_verify(12, 440)  # the history cannot tell
    for _ in range(3):  # another shape, run now and then: half the time the fit gives it
        model.observe(24, 440, 0, 0, 0.0, runs_verify(24, 440))
        model.observe(12, 440, 0, 0, 0.0, runs_verify(12, 440))
    assert model.predict_verify(12, 440) < 1.3 * runs_verify(12, 440)  # still 1.47x if they were left out


def test_shape_probes_teach_the_cost_model_what_one_draft_length_cannot():
    def true_goodput(ks):
        n = len(ks) + sum(ks)
        return n / (runs_verify(n, 440 + sum(ks)) + draft_cost(max(ks), sum(ks)))

    best = max(true_goodput([k] * 4) for k in range(6))
    outcome = {}
    for interval in (0, 8):  # 0: no shape probes
        policy = SmartSpecPolicy(key="t", shape_probe_interval=interval)
        for _ in range(20):  # the history: 5-token drafts at batch 1-5, context growing with the batch
            for b in range(1, 6):
                n, c = 6 * b, 110 * b
                policy.cost.observe(n, c, 5, 5 * b, draft_cost(5, 5 * b), seen_verify(n, c))
        chosen = run_fully_accepted_batch(policy, 200)
        assert chosen[0] == [5] * 4  # both start where the history points
        steady = [ks for step, ks in enumerate(chosen[-48:], start=152) if (step + 1) % 8]  # not the probe steps
        outcome[interval] = (min(true_goodput(ks) for ks in steady), policy.shape_probes)
    assert outcome[0][0] < 0.9 * best and outcome[0][1] == 0  # never learns that 5 tokens are too many
    assert outcome[8][0] > 0.98 * best and 0 < outcome[8][1] <= 200 // 8


def test_no_shape_probe_where_the_optimum_is_sharp():
    policy = drafting_policy(0.0)
    policy.cost.v = [0.1] + [0.0001] * 6 + [0.0]  # verification almost free: 5 tokens beat any shorter draft
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=64)) for i in range(4)]
    for r in requests:
        for _ in range(30):
            policy.acceptance.observe(r.request_id, 5, 5)
    assert all(policy.choose(requests, 5) == [5] * 4 for _ in range(32))
    assert policy.shape_probes == 0
    for bad in ({"shape_probe_interval": -1}, {"shape_probe_interval": 2.5}, {"shape_probe_loss": 1.0}):
        with pytest.raises(ValueError, match="shape_probe"):
            SmartSpecPolicy(**bad)


def test_a_step_with_prefill_drafts_only_what_beats_the_decode_batch_alone():
    params = SamplingParams(max_tokens=64)

    def choose(base_tokens, held):
        prefilling = [Request(f"p{i}", list(range(base_tokens)), params) for i in range(held)]
        p = drafting_policy(0.0)
        p.cost.d = [0.02, 0.001, 0.0]  # 20 ms a draft depth
        requests = [Request(f"r{i}", list(range(100)), params) for i in range(2)]
        for r in requests:
            for _ in range(30):
                p.acceptance.observe(r.request_id, 4, 3)
        return p.choose(requests, 5, base_tokens=base_tokens, base_context=base_tokens, prefilling=prefilling), p

    alone, p = choose(0, 0)
    assert min(alone) >= 2
    # by goodput's ratio, a 100-token prefill that is paid anyway makes drafting look cheaper, not dearer
    gains = p.acceptance.gains(["r0", "r1"], 5)
    by_ratio, _ = select_from_gains(gains, [5, 5], np.arange(1, 6), p.cost.predict, 102, 300)
    assert sum(by_ratio) >= sum(alone)
    with_prefill, _ = choose(100, 1)
    assert sum(with_prefill) < sum(alone)
    holding_more, _ = choose(100, 4)
    assert sum(holding_more) <= sum(with_prefill)


def test_start_costs_keep_gains_non_increasing_and_price_what_does_not_pay():
    gains = np.array([[0.9, 0.81, 0.73, 0.66], [0.9, 0.81, 0.73, 0.66], [0.5, 0.25, 0.12, 0.06]])
    charged = charge_start_costs(gains, [4, 4, 2], np.array([0.0, 1.0, 5.0]))
    assert (charged[0] == gains[0]).all()
    assert all((np.diff(row[:cap]) <= 1e-12).all() for row, cap in zip(charged, [4, 4, 2]))  # within the caps
    assert charged[1, :4].sum() == pytest.approx(gains[1].sum() - 1.0)  # paid once, spread over the best prefix
    assert (charged[2, :2] <= 0).all()  # a start that never pays is never chosen
    ks, _ = select_from_gains(charged, [4, 4, 2], np.arange(1, 5), linear_cost(0.1, 0.001), 3, 300)
    assert ks[0] >= ks[1] > 0 and ks[2] == 0


def drafting_policy(d_catchup):
    """A policy with a known cost model: verification cheap, drafting 5 ms a depth, catch-up d_catchup a token."""
    p = SmartSpecPolicy(key="draft")
    p.cost.v = [0.1] + [0.001] * 6 + [0.0]
    p.cost.d = [0.005, 0.001, d_catchup]
    return p


def test_a_draft_catch_up_is_charged_and_tracked():
    params = SamplingParams(max_tokens=64)
    fresh, seen = Request("fresh", list(range(500)), params), Request("seen", list(range(500)), params)
    for p in (drafting_policy(0.0), drafting_policy(0.005)):
        for _ in range(30):
            p.acceptance.observe("fresh", 4, 4)
            p.acceptance.observe("seen", 4, 4)
        p._draft_seen["seen"] = seen.num_tokens - 1
        ks = p.choose([fresh, seen], 5)
        if p.cost.d[2] == 0:  # catch-up costs nothing: both draft
            assert ks[0] > 0 and ks[1] > 0
            continue
        # reading 499 unseen tokens (2.5 s against 0.1 s steps) does not pay, and is not worth a probe either
        assert ks[0] == 0 and ks[1] > 0 and "fresh" not in p._probing
        assert p.last_prediction == pytest.approx(p.cost.predict(2 + ks[1], 1000 + ks[1], ks[1], ks[1]))
        p.observe(StepRecord(step=1, batch_size=2, ks=ks, proposed=ks, accepted=[0, 2], request_ids=["fresh", "seen"],
                             num_batched_tokens=2 + ks[1], num_prefill_tokens=0, num_context_tokens=1000,
                             draft_s=0.02, verify_s=0.1, total_s=0.12))
        # the draft fed the context and its drafts but the last: it saw the accepted ones, up to k - 1 of them
        assert p._draft_seen["seen"] == 500 + min(2, ks[1] - 1) and "fresh" not in p._draft_seen
        seen.token_ids += [1, 2, 3]  # two drafts accepted and the target's token
        assert p._catchup_tokens([seen, fresh]).tolist() == [502 - p._draft_seen["seen"], 499]


def run19_draft_costs(p: SmartSpecPolicy) -> SmartSpecPolicy:
    """The draft model's costs as fitted on this CPU: verify flat up to 8 tokens, 0.1 s a draft forward, 4.4 ms a
    token of catch-up."""
    p.cost.v = [0.28, 0.0, 0.026, 0.0128, 0.0128, 0.0133, 0.0149, 0.0]
    p.cost.d = [0.10, 0.0, 0.0044]
    return p


def test_a_probe_runs_only_where_its_outcome_could_make_the_request_draft():
    """Costs fitted on the draft model here: verify flat up to 8 tokens, 0.1 s a draft forward, 4.4 ms a token of
    catch-up; 150-token prompts the draft has not read. Every request has had its drafts rejected, so the plan is
    k = 0 and each is due for a probe (and, the prior not yet learned, catch-up alone would not stop one). Alone,
    a request accepted almost surely would pay for its catch-up and drafts many times over: worth finding out. In
    a batch of 8 the catch-ups and the verify tokens past the flat part cost more than the drafts add, even if all
    eight were accepted almost surely: no outcome pays for it."""
    def choose(batch):
        p = run19_draft_costs(SmartSpecPolicy(key="t"))
        requests = [Request(f"r{i}", list(range(150)), SamplingParams(max_tokens=64)) for i in range(batch)]
        for r in requests:  # three rejected drafts each: too few outcomes for the prior to count as learned
            for _ in range(3):
                p.acceptance.observe(r.request_id, 4, 0)
        assert p.acceptance.evidence < p.min_prior_evidence
        return p.choose(requests, 5), p

    ks, alone = choose(1)
    assert ks == [1] and alone._probing == {"r0"}
    ks, batched = choose(8)
    assert ks == [0] * 8 and not batched._probing
    assert batched.last_prediction == pytest.approx(0.28)


def test_a_learning_probe_runs_only_where_what_it_could_reveal_outweighs_its_cost():
    """Two requests decode beside a prefill, none has drafted, the prior is unlearned. Were the proposer near
    perfect, the two drafting together would beat plain decoding by a little a step; a probe (one request reading
    its 150-token prompt, 0.66 s, for one outcome) costs more than that little over the two or so steps before the
    next request is expected (arrivals 2 s apart). With arrivals a minute apart, the same edge lasts for the
    catch-up horizon, and the probe runs."""
    def probes(arrival_gap):
        p = run19_draft_costs(SmartSpecPolicy(key="t"))
        params = SamplingParams(max_tokens=32)
        requests = [Request(f"r{i}", list(range(150)), params, arrival_time=i * arrival_gap) for i in range(2)]
        prefilling = [Request("p", list(range(150)), params, arrival_time=2 * arrival_gap)]
        p.acceptance.observe("finished", 2, 2)
        assert p.acceptance.evidence < p.min_prior_evidence
        ks = p.choose(requests, 5, base_tokens=150, base_context=150, prefilling=prefilling,
                      now=2 * arrival_gap + 0.5)
        assert ks.count(1) == len(p._probing) and sum(ks) == len(p._probing)
        return p._probing

    assert not probes(2.0)
    assert len(probes(60.0)) == 1


def test_a_catch_up_is_priced_over_the_steps_before_the_next_arrival_is_expected():
    """A learned, near-perfect draft model; two requests decode, one of which has read its context, the other not
    its 300-token prompt (1.3 s). Spread over the catch-up horizon (8 steps) that read pays; over the one or two
    steps before the next arrival, when requests arrive every half second, it does not: arrivals bring prefill
    steps and a larger batch, so drafting would not last long enough to pay it back."""
    def choose(arrival_gap):
        p = run19_draft_costs(SmartSpecPolicy(key="t"))
        p.import_state({"key": "t", "prior": {"first": {"accepted": 200, "rejected": 2},
                                              "later": {"accepted": 800, "rejected": 8}}})
        params = SamplingParams(max_tokens=64)
        earlier = [Request(f"e{i}", [1], params, arrival_time=i * arrival_gap) for i in range(6)]
        p.choose(earlier, 5, now=6 * arrival_gap)
        for r in earlier:
            p.release(r)
        seen = Request("seen", list(range(300)), params, arrival_time=6 * arrival_gap)
        fresh = Request("fresh", list(range(300)), params, arrival_time=7 * arrival_gap)
        p._draft_seen["seen"] = seen.num_tokens - 1
        return p.choose([seen, fresh], 5, now=7 * arrival_gap + 0.1)

    sparse, dense = choose(60.0), choose(0.5)
    assert sparse[0] > 0 and sparse[1] > 0
    assert dense[0] > 0 and dense[1] == 0


def test_a_catch_up_beside_a_prefill_is_priced_at_the_decoding_batch_rate():
    """Six requests decode beside a 94-token prefill with a learned, near-perfect draft model; none of them has
    drafted, so each would first read its 97-token context (0.4 s). The catch-ups' seconds are worth what the six
    decoding alone would make of them (about 26 tokens a second), not the prefill step's own rate (about 4 tokens a
    second, its time being the prefill's): priced so, starting them in this step does not pay, while the same batch
    in a step of its own starts, and requests whose context the draft has read draft beside the prefill. (Priced at
    the step's rate, all six started here: run 33's 16-19% losses, docs/BENCH_POLICIES.md.)"""
    def choose(prefill_tokens, seen):
        p = SmartSpecPolicy(key="t")
        p.cost.v = [0.229, 0.0] + [0.002] * 5 + [0.0]
        p.cost.d = [0.075, 0.0, 0.0041]
        p.import_state({"key": "t", "prior": {"first": {"accepted": 200, "rejected": 4},
                                              "later": {"accepted": 800, "rejected": 16}}})
        params = SamplingParams(max_tokens=32)
        requests = [Request(f"r{i}", list(range(97)), params, arrival_time=5.0 * i) for i in range(6)]
        if seen:
            p._draft_seen.update({r.request_id: r.num_tokens - 1 for r in requests})
        prefilling = [Request("p", list(range(prefill_tokens)), params, arrival_time=30.0)] if prefill_tokens else []
        return p.choose(requests, 5, base_tokens=prefill_tokens, base_context=prefill_tokens, prefilling=prefilling,
                        now=30.5)

    assert choose(0, seen=False) == [5] * 6
    assert choose(94, seen=False) == [0] * 6
    assert min(choose(94, seen=True)) > 0


def test_expected_gap_to_the_next_arrival():
    gaps = ArrivalGaps(window=4)
    assert gaps.expected_gap(now=100.0, prior_gap=8.0) == 8.0  # none seen: the prior
    for i in range(4):
        gaps.see(f"r{i}", 10.0 * i)
    gaps.see("r3", 30.0)  # seen again (a request is passed every step): counted once
    assert gaps.expected_gap(now=32.0, prior_gap=8.0) == pytest.approx((32.0 + 8.0) / 4)
    for i in range(4, 12):  # a faster stream pushes the slow one out of the window
        gaps.see(f"r{i}", 30.0 + (i - 3))
    assert gaps.expected_gap(now=39.0, prior_gap=8.0) == pytest.approx((39.0 - 35.0 + 8.0) / 4)
    # no arrival for a while: the gap grows with the wait, and arrivals older than memory * prior_gap (32 s) drop
    assert gaps.expected_gap(now=60.0, prior_gap=8.0) > gaps.expected_gap(now=40.0, prior_gap=8.0)
    assert gaps.expected_gap(now=90.0, prior_gap=8.0) == 8.0
    gaps.see("after", 90.0)  # a new burst after the quiet spell is measured on its own
    assert gaps.expected_gap(now=91.0, prior_gap=8.0) == pytest.approx(1.0 + 8.0)
    # a burst is not yet a rate: four requests at once still expect a quarter of the prior
    burst = ArrivalGaps(window=4)
    for i in range(4):
        burst.see(f"b{i}", 5.0)
    assert burst.expected_gap(now=5.0, prior_gap=8.0) == pytest.approx(2.0)
    for bad in ({"window": 0}, {"memory": 0.0}):
        with pytest.raises(ValueError, match="window"):
            ArrivalGaps(**bad)


# ---- baselines, state, engine ----------------------------------------------------------------------------------
def test_batch_table_policy():
    p = BatchTablePolicy({1: 4, 4: 2, 16: 0})
    assert [p.k_for(b) for b in (1, 2, 4, 8, 16, 64)] == [4, 4, 2, 2, 0, 0]
    assert make_policy("batch_table", 5).k_for(1) == 5
    with pytest.raises(ValueError, match="batch_table"):
        BatchTablePolicy({0: 1})


def test_state_export_merge_import():
    a, b = SmartSpecPolicy(key="ngram"), SmartSpecPolicy(key="ngram")
    for _ in range(40):
        a.acceptance.observe("x", 4, 4)
        b.acceptance.observe("y", 4, 0)
    for n in (1, 2, 4, 8, 16):
        a.cost.observe(n, 100, 0, 0, 0.0, true_verify(n, 100))
        b.cost.observe(n, 100, 0, 0, 0.0, 2 * true_verify(n, 100))
    merged = merge_states([a.export_state(), b.export_state(), {"key": "draft_model:x", "prior": {
        "first": {"accepted": 1e6, "rejected": 0}}, "cost": {}}])
    assert merged["replicas"] == 2  # another proposer's evidence is not mixed in
    fresh = SmartSpecPolicy(key="ngram")
    fresh.import_state(merged)
    assert a.acceptance.first.prior > fresh.acceptance.first.prior > b.acceptance.first.prior
    assert fresh.cost.predict_verify(4, 100) == pytest.approx(1.5 * true_verify(4, 100), rel=0.02)


PROMPTS = ["abcabcabcabc abc", "def f(x): return x\ndef g(x): return x\ndef", "xyz " * 8, "hello world"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_under_smartspec_equals_off(method, tiny_qwen, tiny_qwen_draft, tmp_path):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25, 33, 12)]
    spec = {"method": method, "num_speculative_tokens": 4, "policy": "smartspec"}
    if method == "draft_model":
        spec["model"] = tiny_qwen_draft
    trace = tmp_path / "trace.parquet"
    llm = LLM(tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec,
              trace_path=str(trace))
    policy = llm.engine.speculator.policy
    assert isinstance(policy, SmartSpecPolicy) and policy.cost.ready  # seeded by the warm-up profile
    outs = llm.generate(PROMPTS, params)
    off = LLM(tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    llm.engine.close()
    rows = pq.read_table(trace).to_pylist()
    assert len(rows) == llm.engine.num_steps
    assert {"ks", "accepted", "num_batched_tokens", "num_context_tokens", "predicted_s", "draft_s", "verify_s",
            "total_s", "batch_size"} <= set(rows[0])
    assert any(r["predicted_s"] for r in rows)
    # every prompt token is prefilled exactly once (no preemption here), and no decode counts as prefill
    assert sum(r["num_prefill_tokens"] for r in rows) == sum(len(o.prompt_token_ids) for o in outs)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
