"""The realistic simulator's parts: noisy steps, the engine's warm-up profile through that noise, the per-request
oracle, closed loops with common random numbers, and the draft's price checked while nothing drafts."""
import numpy as np
import pytest

from smartspec.policy import GoodputPolicy
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.price_check import DraftPriceCheck
from smartspec.sim.closed_loop import closed_loop
from smartspec.sim.realism import (CALIBRATION_TOKENS, Realism, StepNoise, calibration_records,
                                   profile_records)
from smartspec.sim.surfaces import SURFACES
from smartspec.sim.workload import RequestAcceptance, Workload
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.step_record import StepRecord

from policy_views import view


def test_step_noise_jitters_around_one_and_stalls_as_often_as_asked():
    rng = np.random.default_rng(0)
    factors = np.array([StepNoise(0.05, 0.02, (3.0, 3.0)).factor(rng) for _ in range(20000)])
    stalls = factors > 2.0
    assert 0.015 < stalls.mean() < 0.025
    assert np.median(factors[~stalls]) == pytest.approx(1.0, abs=0.01)
    assert np.std(np.log(factors[~stalls])) == pytest.approx(0.05, rel=0.05)
    assert StepNoise().factor(rng) == 1.0
    with pytest.raises(ValueError):
        StepNoise(stall_p=1.0)
    with pytest.raises(ValueError):
        Realism(host_s="sometimes")


def test_the_profile_runs_the_engines_shapes_scaled_as_the_profile_ran():
    """Per batch and k in {0, 1, 2, K}: two steps, the first after the prompts' catch-up; draft and verify times
    from the surface, each scaled by the profile's factor."""
    profile = SURFACES["zen4"].profile()
    records = profile_records(profile, Realism(profile_scale=(2.0, 6.0)), 5, np.random.default_rng(0))
    assert [(r.batch_size, r.ks[0]) for r in records] == [(n, k) for n in (1, 4) for k in (0, 1, 2, 5)
                                                           for _ in range(2)]
    first, second = records[6], records[7]  # batch 1, k = 5
    assert first.draft_catchup_tokens == 63 and second.draft_catchup_tokens == 0
    assert first.draft_s == pytest.approx(6.0 * float(profile.cost.predict_draft(5, 5, 63)))
    assert first.verify_s == pytest.approx(2.0 * float(profile.cost.predict_verify(6, 69)))
    padded = profile_records(profile, Realism(profile_batches=(1, 4, 16, 64)), 5, np.random.default_rng(0))
    assert sorted({r.batch_size for r in padded}) == [1, 4, 16, 64]


def test_calibration_answers_draw_from_the_workloads_acceptance():
    answers = [RequestAcceptance(1.0, 1.0, 0, np.random.default_rng(i)) for i in range(4)]
    records = calibration_records(answers, 5)
    made = {}
    for r in records:
        for rid, accepted in zip(r.request_ids, r.accepted):
            made[rid] = made.get(rid, 0) + accepted + 1
    assert set(made.values()) == {CALIBRATION_TOKENS}
    assert all(a == k for r in records for a, k in zip(r.accepted, r.ks))  # all accepted at rate 1


def test_a_request_drifts_from_its_first_rate_to_its_second():
    spec = Workload("mixed").request(3, 1)
    a = spec.acceptance
    assert 64 <= spec.max_tokens <= 256 and 64 <= spec.prompt_len <= 512
    assert a.rate(0) == a.first and a.rate(spec.max_tokens) == a.then
    assert a.expected_tokens(0, 0) == 1.0
    assert a.expected_tokens(2, a.switch_at) == pytest.approx(1 + a.then + a.then ** 2)
    assert Workload("mixed").request(3, 1).acceptance.first == a.first  # seeded per request
    with pytest.raises(ValueError):
        Workload("bimodal")


def test_the_oracle_beats_fixed_k_and_no_speculation_on_the_exact_surface():
    """On the exact simulator (no noise, no host time) the oracle, knowing each request's acceptance, is at least as
    fast as every fixed k and off in a closed loop of mixed requests, and a seed repeats itself."""
    surface = SURFACES["h200"]
    runs = {policy: closed_loop(surface.profile(), policy, 4, 4, 20, Workload("mixed"), Realism(), seed=1)
            for policy in ("off", "fixed:1", "fixed:2", "fixed:4", "oracle")}
    best_fixed = max(r.tokens_per_s for p, r in runs.items() if p != "oracle")
    assert runs["oracle"].tokens_per_s >= 0.99 * best_fixed, {p: r.tokens_per_s for p, r in runs.items()}
    again = closed_loop(surface.profile(), "oracle", 4, 4, 20, Workload("mixed"), Realism(), seed=1)
    assert again == runs["oracle"]
    assert runs["fixed:2"].mean_k == pytest.approx(2.0, abs=0.3)
    with pytest.raises(ValueError):
        closed_loop(surface.profile(), "off", 4, 4, 8, Workload(), Realism(), seed=1)


def test_measured_host_time_is_added_to_every_step():
    surface = SURFACES["h200"]
    free = closed_loop(surface.profile(), "smartspec", 4, 2, 9, Workload(), Realism(), seed=0)
    paid = closed_loop(surface.profile(), "smartspec", 4, 2, 9, Workload(), Realism(host_s=0.01), seed=0)
    assert free.host_s == 0.0 and paid.host_s == pytest.approx(0.01)
    assert paid.seconds > free.seconds + 0.009 * free.steps


def test_a_price_check_backs_off_while_it_agrees_and_returns_when_it_does_not():
    check = DraftPriceCheck(first=4, longest=16)
    assert not check.is_due(3) and check.is_due(4)
    check.ran(4)
    assert not check.is_due(7)
    assert check.measured(8, 1.1)  # agrees: the next only in 16
    assert not check.is_due(23) and check.is_due(24)
    assert not check.measured(40, 0.2)  # the price was 5x too high: checks again soon
    assert check.interval == 4 and check.is_due(44)


def test_the_draft_price_follows_served_draft_steps_not_the_profile():
    """A profile that priced the draft 6x its cost; one served draft step later, the draft's fit is the
    profile's shape at the served level, while the verify fit keeps the profile's level."""
    cost = StepCostModel()
    for n in (1, 4):
        for k in (0, 1, 2, 5):
            for _ in range(2):
                cost.observe(n * (k + 1), 64 * n, k, n * k, 6 * (0.01 * k + 0.001 * n * k) if k else 0.0,
                             0.02 + 0.001 * n * (k + 1), refit=False)
    cost.refit()
    cost.hold_prior()
    assert cost.predict_draft(1, 1) == pytest.approx(6 * 0.011, rel=0.05)
    cost.observe(2, 130, 1, 1, 0.011, 0.022)
    assert cost.predict_draft(1, 1) == pytest.approx(0.011, rel=0.05)
    assert cost.predict_verify(4, 256) == pytest.approx(0.02 + 0.004, rel=0.1)


def test_a_policy_that_drafts_nothing_checks_the_drafts_price_now_and_then():
    """No request would draft (the draft is priced far above what it could add); every so often one token for the
    request whose catch-up is cheapest checks that price, and a check that finds it right puts the next off long."""
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=4000)) for i in range(4)]
    policy = GoodputPolicy(key="t")
    policy.observe_profile([StepRecord(0, n, [k] * n, [k] * n, [0] * n, [], n * (k + 1), 0, 64 * n,
                                       1.0 * k, 0.02, 0.02 + 1.0 * k)
                            for n in (1, 4) for k in (0, 1, 2, 5) for _ in range(2)])
    checked = []
    for step in range(1, 400):
        plan = policy.plan(view(requests, 5))
        if any(plan.ks):
            checked.append(step)
            assert sum(plan.ks) == 1
        policy.observe(StepRecord(step, 4, plan.ks, plan.ks, [0] * 4, [f"r{i}" for i in range(4)], 4 + sum(plan.ks),
                                  0, 400, 1.0 * any(plan.ks), 0.02, 0.02 + 1.0 * any(plan.ks),
                                  num_tokens=[100] * 4))
    assert checked == [64]  # the next after 1,024 more steps


def test_beside_lookups_a_draft_priced_too_dear_is_checked_with_one_draft_token():
    """With the draft model and lookups offered per request, a profile that priced the draft far too dear leaves
    every request to the lookups or to k = 0; now and then one request at k = 0 drafts one token with the draft
    model to check that price, and once checked right, the draft model is chosen."""
    from smartspec.types.plan import DRAFT
    from smartspec.types.tree import TokenTree

    policy = GoodputPolicy(key="t")
    policy.observe_profile([StepRecord(0, n, [k] * n, [k] * n, [0] * n, [], n * (k + 1), 0, 64 * n,
                                       1.0 * k, 0.02, 0.02 + 1.0 * k)
                            for n in (1, 4) for k in (0, 1, 2, 5) for _ in range(2)])
    policy.observe_calibration([StepRecord(0, 1, [4], [4], [4], ["c"], 5, 0, 0, 0.0, 0.0, 0.0)] * 20)
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=4000)) for i in range(2)]
    first_draft = None
    for step in range(1, 130):
        plan = policy.plan(view(requests, 4, lookups=[TokenTree([], [], [])] * 2, use_draft=True))
        drafted = [k for m, k in zip(plan.methods, plan.ks) if m == DRAFT]
        if any(drafted) and first_draft is None:
            first_draft = step
            assert drafted == [1]  # the check: one token
        draft_s = 0.002 * max(drafted, default=0)  # the draft's real price: 500x below the profile's
        policy.observe(StepRecord(step, 2, plan.ks, plan.ks, plan.ks, [r.request_id for r in requests],
                                  2 + sum(plan.ks), 0, 200, draft_s, 0.02, 0.02 + draft_s, methods=plan.methods,
                                  num_tokens=[100, 100]))
    assert first_draft == 64
    assert sum(k for m, k in zip(plan.methods, plan.ks) if m == DRAFT) > 2  # drafting for real, priced right
