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


def every_plan_can_pay(k_top, rows, alpha, cost, base_tokens, base_context, tokens_of=None) -> bool:
    """The bound by its definition: every draft count m and depth priced at the step's context."""
    m = np.arange(1, rows * k_top + 1)
    cumulative = np.cumsum(alpha ** ((m - 1) // rows + 1))  # the m largest gains: rows of a^1, then of a^2, ...
    depths = np.arange(1, k_top + 1)[:, None]
    tokens = base_tokens + m if tokens_of is None else np.stack(
        [np.broadcast_to(tokens_of(m, d), m.shape) for d in range(1, k_top + 1)])
    values = (rows + cumulative) / cost(tokens, base_context + m, depths, m)
    values[m[None, :] > rows * depths] = -np.inf
    plain = base_tokens if tokens_of is None else tokens_of(0, 0)
    return bool(values.max() > rows / float(cost(plain, base_context, 0, 0)))


def random_bound_instances(n: int, seed: int):
    from smartspec.policy.cost_model import StepCostModel

    rng = np.random.default_rng(seed)
    for _ in range(n):
        model = StepCostModel()
        model.v = [rng.uniform(0.001, 0.05)] + (rng.uniform(0, 2e-3, 6) * (rng.random(6) < 0.7)).tolist() + [
            rng.uniform(0, 1e-6) * (rng.random() < 0.9)]
        model.d = [rng.uniform(0, 0.01), rng.uniform(0, 1e-3), 0.0]
        rows, k_top = int(rng.integers(1, 300)), int(rng.integers(1, 9))
        base = rows + int(rng.integers(0, 3)) * int(rng.integers(0, 200))
        yield model, k_top, rows, float(rng.uniform(0.2, 0.99)), base, int(rng.integers(rows, 2000 * rows))


def test_the_drafting_bound_answers_as_every_plan_priced_at_the_context():
    """drafting_bound.drafting_pays_above, priced at the layer ends and the cost's kinks alone and turned into a
    context threshold, says what pricing every plan at the step's context says: random piecewise-linear costs,
    batches, depths and ceilings, many near the edge between paying and not."""
    from smartspec.policy.cost_model import SEGMENT_EDGES
    from smartspec.policy.drafting_bound import BoundShape, drafting_pays_above

    answers = []
    for model, k_top, rows, alpha, base, context in random_bound_instances(3000, 11):
        every = every_plan_can_pay(k_top, rows, alpha, model.predict, base, context)
        above = drafting_pays_above(BoundShape(k_top, rows, base), alpha, model.predict, model.v[-1], SEGMENT_EDGES)
        assert (context > above) == every, (k_top, rows, alpha, base, context, above)
        answers.append(every)
    assert 0.2 < np.mean(answers) < 0.8  # both answers, often


def test_where_the_bound_says_no_the_exact_plan_drafts_nothing():
    """The bound holds: where no plan could pay at the ceiling, the exact selection over gains at or below it
    chooses no speculation."""
    from smartspec.policy.cost_model import SEGMENT_EDGES
    from smartspec.policy.drafting_bound import BoundShape, drafting_pays_above

    checked = 0
    rng = np.random.default_rng(3)
    for model, k_top, rows, alpha, base, context in random_bound_instances(2000, 12):
        if rows > 96 or context > drafting_pays_above(BoundShape(k_top, rows, base), alpha, model.predict,
                                                      model.v[-1], SEGMENT_EDGES):
            continue
        gains = chain_gains(rng.uniform(0.0, alpha, rows), k_top)
        ks, _ = select_from_gains(gains, [k_top] * rows, np.arange(1, k_top + 1), model.predict, base, context)
        assert not any(ks)
        checked += 1
    assert checked > 50


def every_priced_plan_can_pay(k_top, rows, n_prefilling, alpha, cost, step_tokens, step_context,
                              decode_context) -> bool:
    """The prefill step's bound by its definition: every plan's drafts priced at p = (rows + prefilling) / T_0(C_d),
    the least price prefill_step_price can set."""
    m = np.arange(1, rows * k_top + 1)
    cumulative = np.cumsum(alpha ** ((m - 1) // rows + 1))
    depths = np.arange(1, k_top + 1)[:, None]
    price = (rows + n_prefilling) / float(cost(rows, decode_context, 0, 0))
    added = cost(step_tokens + m, step_context + m, depths, m) - float(cost(step_tokens, step_context, 0, 0))
    values = cumulative - price * added
    values[m[None, :] > rows * depths] = -np.inf
    return bool(values.max() > 0)


def test_the_prefill_bound_answers_as_every_priced_plan():
    """drafting_pays_above for a step with prefill, priced at layer ends and kinks and turned into a threshold on the
    decoding requests' context, says what pricing every plan of a step with prefill says."""
    from smartspec.policy.cost_model import SEGMENT_EDGES
    from smartspec.policy.drafting_bound import BoundShape, drafting_pays_above

    answers, rng = [], np.random.default_rng(5)
    for model, k_top, rows, alpha, base, context in random_bound_instances(3000, 13):
        n_prefilling, chunk = int(rng.integers(1, 4)), int(rng.integers(1, 600))
        step_tokens, step_context = base + chunk, context + int(rng.integers(chunk, 4 * chunk + 1))
        every = every_priced_plan_can_pay(k_top, rows, n_prefilling, alpha, model.predict, step_tokens, step_context,
                                          context)
        shape = BoundShape(k_top, rows, step_tokens, prefilling=n_prefilling)
        above = drafting_pays_above(shape, alpha, model.predict, model.v[-1], SEGMENT_EDGES)
        assert (context > above) == every, (k_top, rows, n_prefilling, alpha, step_tokens, context, above)
        answers.append(every)
    assert 0.1 < np.mean(answers) < 0.9


def test_where_the_prefill_bound_says_no_the_priced_plan_drafts_nothing():
    """The policy's own path on a step with prefill (chain_plan.prefill_step_price, then the priced selection) keeps
    no draft wherever the bound says none could pay at the ceiling."""
    from smartspec.policy.chain_plan import prefill_step_price
    from smartspec.policy.cost_model import SEGMENT_EDGES
    from smartspec.policy.drafting_bound import BoundShape, drafting_pays_above
    from smartspec.policy.step_numbers import StepNumbers
    from smartspec.types.plan import PrefillView, RequestView, StepView

    checked, rng = 0, np.random.default_rng(6)
    for model, k_top, rows, alpha, base, context in random_bound_instances(2000, 14):
        if rows > 64:
            continue
        n_prefilling, chunk = int(rng.integers(1, 4)), int(rng.integers(1, 600))
        per_row = max(1, context // rows)
        view = StepView([RequestView(f"r{i}", per_row, 1, 10 ** 6, None, 0.0) for i in range(rows)], k_top,
                        prefill_tokens=chunk, prefill_context=chunk * 2,
                        prefilling=[PrefillView(f"p{j}", 0.0) for j in range(n_prefilling)])
        step = StepNumbers.of(view, 0.0)
        shape = BoundShape(k_top, rows, step.tokens, prefilling=n_prefilling)
        if step.decode_context > drafting_pays_above(shape, alpha, model.predict, model.v[-1], SEGMENT_EDGES):
            continue
        gains = chain_gains(rng.uniform(0.0, alpha, rows), k_top)
        depth_of = np.arange(1, k_top + 1)
        price = prefill_step_price(gains, step, depth_of, model.predict)
        ks, _ = select_from_gains(gains, step.caps, depth_of, model.predict, step.tokens, step.context, price)
        assert not any(ks)
        checked += 1
    assert checked > 50


def test_the_bound_holds_for_a_padded_runner():
    """The bound on a runner that pads every row to the deepest chain's width (a bucket's cells per depth, the real
    tokens beyond the largest bucket) says what pricing every plan says."""
    from smartspec.policy.cost_model import SEGMENT_EDGES
    from smartspec.policy.drafting_bound import BoundShape, drafting_pays_above

    answers = []
    for model, k_top, rows, alpha, base, context in random_bound_instances(3000, 15):
        def padded(m, depth, rows=rows, base=base):
            cells = -(-rows // 8) * 8 * (depth + 1)
            return base + m if cells > 2048 else m * 0 + cells

        every = every_plan_can_pay(k_top, rows, alpha, model.predict, base, context, padded)
        above = drafting_pays_above(BoundShape(k_top, rows, base, tokens_of=padded), alpha, model.predict,
                                    model.v[-1], SEGMENT_EDGES)
        assert (context > above) == every, (k_top, rows, alpha, base, context, above)
        answers.append(every)
    assert 0.1 < np.mean(answers) < 0.9
