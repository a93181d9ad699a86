"""Selection by goodput: exact per depth bound, priced steps, start costs."""
import itertools
import random

import numpy as np
import pytest
from costs import linear_cost

from smartspec.policy.goodput import (
    chain_gains,
    charge_start_costs,
    expected_tokens,
    goodput,
    select_from_gains,
    select_k,
)


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

def test_start_costs_keep_gains_non_increasing_and_price_what_does_not_pay():
    gains = np.array([[0.9, 0.81, 0.73, 0.66], [0.9, 0.81, 0.73, 0.66], [0.5, 0.25, 0.12, 0.06]])
    charged = charge_start_costs(gains, [4, 4, 2], np.array([0.0, 1.0, 5.0]))
    assert (charged[0] == gains[0]).all()
    assert all((np.diff(row[:cap]) <= 1e-12).all() for row, cap in zip(charged, [4, 4, 2]))  # within the caps
    assert charged[1, :4].sum() == pytest.approx(gains[1].sum() - 1.0)  # paid once, spread over the best prefix
    assert (charged[2, :2] <= 0).all()  # a start that never pays is never chosen
    ks, _ = select_from_gains(charged, [4, 4, 2], np.arange(1, 5), linear_cost(0.1, 0.001), 3, 300)
    assert ks[0] >= ks[1] > 0 and ks[2] == 0
