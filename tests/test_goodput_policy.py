"""The goodput policy as a whole: shape probes, prefill pricing, catch-up charging, probes, state exchange, and
the engine under it equal to plain decoding."""

import dataclasses
import random

import numpy as np
import pyarrow.parquet as pq
import pytest
from costs import draft_cost, runs_verify, seen_verify, true_verify
from policy_views import view

from smartspec import LLM, SamplingParams
from smartspec.policy import GoodputPolicy, merge_states
from smartspec.policy.catchup import growths_drafting_lasts
from smartspec.policy.goodput import select_from_gains
from smartspec.policy.step_numbers import StepNumbers
from smartspec.types.request import Request
from smartspec.types.step_record import StepRecord


def run_fully_accepted_batch(policy, steps, b=4):
    """b requests whose drafts are always accepted, each step costed by runs_verify; the ks of each step, and the
    steps that ran a shape probe."""
    requests = [Request(f"r{i}", list(range(105)), SamplingParams(max_tokens=10_000)) for i in range(b)]
    for r in requests:
        for _ in range(20):
            policy.acceptance.observe(r.request_id, 5, 5)
    chosen, probe_steps = [], set()
    for step in range(steps):
        probes = policy.shape_probes
        ks = policy.plan(view(requests, 5)).ks
        if policy.shape_probes > probes:
            probe_steps.add(step)
        n, c, depth = b + sum(ks), sum(r.num_tokens for r in requests) + sum(ks), max(ks)
        verify, drafting = runs_verify(n, c), draft_cost(depth, sum(ks))
        policy.observe(StepRecord(step, b, ks, ks, ks, [r.request_id for r in requests], n, 0, c, drafting, verify,
                                  verify + drafting, num_tokens=[r.num_tokens for r in requests]))
        chosen.append(ks)
    return chosen, probe_steps

def test_shape_probes_teach_the_cost_model_what_one_draft_length_cannot():
    def true_goodput(ks):
        n = len(ks) + sum(ks)
        return n / (runs_verify(n, 440 + sum(ks)) + draft_cost(max(ks), sum(ks)))

    best = max(true_goodput([k] * 4) for k in range(6))
    outcome = {}
    for interval in (0, 8):  # 0: no shape probes
        policy = GoodputPolicy(key="t", shape_probe_interval=interval)
        for _ in range(20):  # the history: 5-token drafts at batch 1-5, context growing with the batch
            for b in range(1, 6):
                n, c = 6 * b, 110 * b
                policy.cost.observe(n, c, 5, 5 * b, draft_cost(5, 5 * b), seen_verify(n, c))
        chosen, probe_steps = run_fully_accepted_batch(policy, 200)
        assert chosen[0] == [5] * 4  # both start where the history points
        steady = [ks for step, ks in enumerate(chosen[-48:], start=152) if step not in probe_steps]
        outcome[interval] = (min(true_goodput(ks) for ks in steady), policy.shape_probes)
    assert outcome[0][0] < 0.9 * best and outcome[0][1] == 0  # never learns that 5 tokens are too many
    assert outcome[8][0] > 0.98 * best and 0 < outcome[8][1] <= 200 // 8


def test_the_cost_model_keeps_every_step_and_is_refitted_every_refit_every_steps():
    """A fit is a few robust least-squares solves, about 2% of a CPU decode step: the policy records every step and
    refits once every refit_every of them (and after each step until the model has a fit at all), where the fits
    keep missing steps (each runs 20% faster than the one before: cost_feed stretches the gap only while fits
    predict)."""
    with pytest.raises(ValueError, match="refit_every"):
        GoodputPolicy(refit_every=0)
    policy = GoodputPolicy(key="t", refit_every=4)
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=10_000)) for i in range(2)]
    fits = []
    for step in range(1, 17):
        ks = [step % 3, 0]  # shapes vary, so every fit differs from the one before
        n, c = 2 + sum(ks), 200 + 7 * step + sum(ks)
        verify, drafting = true_verify(n, c) * 0.8 ** step, draft_cost(max(ks), sum(ks))
        policy.observe(StepRecord(step, 2, ks, ks, ks, [r.request_id for r in requests], n, 0, c, drafting,
                                  verify, verify + drafting, num_tokens=[r.num_tokens for r in requests]))
        assert len(policy.cost.verify_samples) == step
        fits.append(None if policy.cost.v is None else list(policy.cost.v))
    first = next(i for i, v in enumerate(fits) if v is not None)  # ready after min_samples steps, fitted each step
    assert first == policy.cost.min_samples - 1
    changed = [i for i in range(first + 1, len(fits)) if fits[i] != fits[i - 1]]
    assert changed == list(range(first + 4, len(fits), 4))
    assert policy.cost.d[0] > 0  # the draft forwards were fitted too


def test_no_shape_probe_where_the_optimum_is_sharp():
    policy = drafting_policy(0.0)
    policy.cost.v = [0.1] + [0.0001] * 6 + [0.0]  # verification almost free: 5 tokens beat any shorter draft
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=64)) for i in range(4)]
    for r in requests:
        for _ in range(30):
            policy.acceptance.observe(r.request_id, 5, 5)
    assert all(policy.plan(view(requests, 5)).ks == [5] * 4 for _ in range(32))
    assert policy.shape_probes == 0
    for bad in ({"shape_probe_interval": -1}, {"shape_probe_interval": 2.5}, {"shape_probe_loss": 1.0}):
        with pytest.raises(ValueError, match="shape_probe"):
            GoodputPolicy(**bad)


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
        return p.plan(view(requests, 5, base_tokens=base_tokens, base_context=base_tokens, prefilling=prefilling)).ks, p

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

def drafting_policy(d_catchup):
    """A policy with a known cost model: verification cheap, drafting 5 ms a depth, catch-up d_catchup a token."""
    p = GoodputPolicy(key="draft")
    p.cost.v = [0.1] + [0.001] * 6 + [0.0]
    p.cost.d = [0.005, 0.001, d_catchup]
    return p


def full_plans_counted(policy: GoodputPolicy) -> list[int]:
    """Counts the policy's full plans, in plan() and made ahead (policy.planned_ahead counts the latter)."""
    made = [0]
    chains = policy._plan_chains

    def counted(step, at):
        made[0] += 1
        return chains(step, at)

    policy._plan_chains = counted
    return made


def test_a_full_plan_due_next_step_is_made_beside_this_steps_forward_and_taken_as_made():
    """Where the next step's hold runs out, its full plan is made beside this step's forward (plan_ahead); the next
    step takes it as made: the plan a full plan of that step would have made, with no full plan before its forward.
    Where the requests changed in between, it is held: its draft lengths for those it planned, the rule's for one
    that joined."""
    import copy
    p = drafting_policy(0.0)
    p.shape_probe_interval = 0  # a shape probe changes the plan: compared here, the plan itself
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=10_000)) for i in range(5)]
    for i, r in enumerate(requests):
        for _ in range(30):
            p.acceptance.observe(r.request_id, 5, 5 if i % 2 else 1)
    full, taken, twin = full_plans_counted(p), 0, None
    for _ in range(40):
        v = view(requests[:4], 5)
        ks = p.plan(v).ks
        if twin is not None:  # a plan was made ahead: the twin, copied before, plans this step in full
            assert twin.plan(v).ks == ks
            taken += 1
        twin = copy.deepcopy(p) if p.plan_hold.plans_in_full(p.step + 1, False, v.requests.ids) else None
        if twin is not None:
            del twin._plan_chains  # its own, not p's counted one
        p.plan_ahead(v)
    assert p.planned_ahead >= 4 and taken == p.planned_ahead - (twin is not None)
    assert full[0] == 1 + p.planned_ahead  # the first step's alone was made in plan(): every later one ahead

    while not p.ahead:  # the next full plan made ahead, then r3 leaves and r4 joins
        v = view(requests[:4], 5)
        p.plan(v)
        p.plan_ahead(v)
    ahead = dict(zip(p.ahead[False].ids, p.ahead[False].plan.ks))
    plan = p.plan(view(requests[:3] + requests[4:], 5))
    assert full[0] == 1 + p.planned_ahead and plan.ks[:3] == [ahead[f"r{i}"] for i in range(3)] and plan.ks[3] > 0


def test_beside_a_prefill_the_joining_request_and_the_next_prefill_step_are_planned_ahead():
    """A step that completes a prompt: beside its forward the held plan's rule plans the request that joins, and
    where the hold of the plan for steps beside prefill runs out, that plan is made too (the next step likely
    carries prefill as well). The next step, beside prefill or not, then plans nothing in full and no newcomer:
    each gets the k that planning it then would have given it."""
    import copy
    p = drafting_policy(0.0)
    p.shape_probe_interval = 0
    requests = [Request(f"r{i}", list(range(100 + i)), SamplingParams(max_tokens=10_000)) for i in range(7)]
    for i, r in enumerate(requests):
        for _ in range(30):
            p.acceptance.observe(r.request_id, 5, 5 if i % 2 else 1)
    decoding, joining, later = requests[:5], requests[5], requests[6]
    for _ in range(3):  # a plan for steps beside prefill, and one for steps without, each held once
        for tokens, prefilling in ((0, ()), (100, (later,))):
            p.plan(view(decoding, 5, base_tokens=tokens, base_context=tokens, prefilling=prefilling))
    full, newcomers = full_plans_counted(p), [0]
    rule = p._newcomer_ks

    def counted(step, rows, rule_):
        newcomers[0] += 1
        return rule(step, rows, rule_)

    for prefilling in ((), (later,)):  # the next step decodes alone, or beside another prompt
        for _ in range(40):  # up to the step before the last the plan beside prefill holds for
            ids = tuple(r.request_id for r in decoding)
            hold = p.plan_hold
            if hold.plans_in_full(p.step + 2, True, ids) and not hold.plans_in_full(p.step + 1, True, ids):
                break
            p.plan(view(decoding, 5, base_tokens=100, base_context=100, prefilling=(later,)))
        now = view(decoding, 5, base_tokens=joining.num_tokens, base_context=joining.num_tokens, prefilling=(joining,),
                   joining=(joining,))
        p.plan(now)
        twin = copy.deepcopy(p)
        del twin._plan_chains
        made, p._newcomer_ks = full[0], counted
        p.plan_ahead(now)
        assert newcomers[0] >= 1 and p.ahead.get(True) is not None
        newcomers[0], made = 0, full[0]
        tokens = 100 if prefilling else 0
        nxt = view(decoding + [joining], 5, base_tokens=tokens, base_context=tokens, prefilling=prefilling)
        assert p.plan(nxt).ks == twin.plan(nxt).ks
        assert newcomers[0] == 0 and full[0] == made  # nothing planned before the forward
        del p._newcomer_ks


def test_a_batch_turned_mostly_new_since_its_plan_is_planned_ahead_in_full():
    """A decoding step's plan is held apart from one beside prefill: where steps beside prefill have run since it, and
    more than a quarter of the requests are new to it, the next decoding step would plan in full before its forward.
    Beside the last step's forward that plan is made ahead instead, and the next step takes it as made."""
    p = drafting_policy(0.0)
    p.shape_probe_interval = 0
    requests = [Request(f"r{i}", list(range(100 + i)), SamplingParams(max_tokens=10_000)) for i in range(8)]
    prompt = Request("p", list(range(100)), SamplingParams())
    for i, r in enumerate(requests):
        for _ in range(30):
            p.acceptance.observe(r.request_id, 5, 5 if i % 2 else 1)
    old, mostly_new = requests[:4], requests[:1] + requests[4:]  # three left, four joined
    ids = tuple(r.request_id for r in old)
    while p.step < 3 or p.plan_hold.plans_in_full(p.step + 3, False, ids):  # a decoding plan for the first four
        p.plan(view(old, 5))
    beside = view(mostly_new, 5, base_tokens=100, base_context=100, prefilling=(prompt,))
    p.plan(beside)  # a step beside prefill: planned by its own plan
    full = full_plans_counted(p)
    p.plan_ahead(beside)
    assert p.ahead[False].ids == beside.requests.ids and full[0] >= 1
    made = full[0]
    p.plan(view(mostly_new, 5))
    assert full[0] == made  # the decoding step took the plan made ahead: nothing planned before its forward


def test_a_draft_catch_up_is_charged_and_tracked():
    params = SamplingParams(max_tokens=64)
    fresh, seen = Request("fresh", list(range(500)), params), Request("seen", list(range(500)), params)
    for p in (drafting_policy(0.0), drafting_policy(0.005)):
        for _ in range(30):
            p.acceptance.observe("fresh", 4, 4)
            p.acceptance.observe("seen", 4, 4)
        p.catchup.seen["seen"] = seen.num_tokens - 1
        plan = p.plan(view([fresh, seen], 5))
        ks = plan.ks
        if p.cost.d[2] == 0:  # catch-up costs nothing: both draft
            assert ks[0] > 0 and ks[1] > 0
            continue
        # reading 499 unseen tokens (2.5 s against 0.1 s steps) does not pay, and is not worth a probe either
        assert ks[0] == 0 and ks[1] > 0 and "fresh" not in plan.probes
        assert plan.predicted_s == pytest.approx(p.cost.predict(2 + ks[1], 1000 + ks[1], ks[1], ks[1]))
        p.observe(StepRecord(step=1, batch_size=2, ks=ks, proposed=ks, accepted=[0, 2], request_ids=["fresh", "seen"],
                             num_batched_tokens=2 + ks[1], num_prefill_tokens=0, num_context_tokens=1000,
                             draft_s=0.02, verify_s=0.1, total_s=0.12, num_tokens=[fresh.num_tokens, seen.num_tokens]))
        # the draft fed the context and its drafts but the last: it saw the accepted ones, up to k - 1 of them
        assert p.catchup.seen["seen"] == 500 + min(2, ks[1] - 1) and "fresh" not in p.catchup.seen
        seen.token_ids += [1, 2, 3]  # two drafts accepted and the target's token
        step = StepNumbers.of(view([seen, fresh], 5), 0.0)
        assert p.catchup.tokens(step).tolist() == [502 - p.catchup.seen["seen"], 499]


def test_a_context_the_drafts_prefix_cache_holds_is_not_charged_as_a_catch_up():
    """The request the test above leaves at k = 0 (499 unseen tokens at 5 ms) drafts where the draft's prefix cache
    holds 496 of them (a prompt another request drafted for): only the 3 past them are charged; once it drafted,
    the more of what its outcomes and the proposer say the draft read counts."""
    params = SamplingParams(max_tokens=64)
    fresh, other = Request("fresh", list(range(500)), params), Request("other", list(range(1000, 1500)), params)
    p = drafting_policy(0.005)
    for _ in range(30):
        p.acceptance.observe("fresh", 4, 4)
        p.acceptance.observe("other", 4, 4)
    cached = {"fresh": 496}
    step = StepNumbers.of(view([fresh, other], 5, draft_held=cached), 0.0)
    assert p.catchup.tokens(step).tolist() == [3, 499]
    ks = p.plan(view([fresh, other], 5, draft_held=cached)).ks
    assert ks[0] > 0 and ks[1] == 0
    p.catchup.observed(["fresh"], [fresh.num_tokens], [ks[0]], [ks[0]])
    fresh.token_ids += [1] * (ks[0] + 1)
    assert p.catchup.tokens(StepNumbers.of(view([fresh], 5, draft_held={"fresh": 0}), 0.0)).tolist() == [1]
    # what the draft holds counts where the ledger has not seen it read yet (a plan made before the outcome)
    other.token_ids += [1]
    assert p.catchup.tokens(StepNumbers.of(view([other], 5, draft_held={"other": 500}), 0.0)).tolist() == [0]


def cpu_draft_model_costs(p: GoodputPolicy) -> GoodputPolicy:
    """The draft model's costs as fitted on this CPU: verify flat up to 8 tokens, 0.1 s a draft forward, 4.4 ms a
    token of catch-up."""
    p.cost.v = [0.28, 0.0, 0.026, 0.0128, 0.0128, 0.0133, 0.0149, 0.0]
    p.cost.d = [0.10, 0.0, 0.0044]
    return p


def random_chain_step(seed: int) -> tuple[GoodputPolicy, StepNumbers, int]:
    """A policy with a random cost fit, a learned prior (low or high), some requests with outcomes, some whose context
    the draft has read (a cheap catch-up), some not due a probe, maybe a prefill beside; the step it plans and at."""
    rng = random.Random(seed)
    p = GoodputPolicy(key="t")
    p.cost.v = [rng.uniform(0.005, 0.05)] + [rng.choice([0.0, rng.uniform(1e-5, 2e-3)]) for _ in range(6)] + [
        rng.uniform(0.0, 2e-6)]
    p.cost.d = [rng.uniform(1e-3, 0.05), rng.uniform(0.0, 1e-3),
                rng.choice([0.0, rng.uniform(1e-4, 1e-3), rng.uniform(1e-4, 1e-3)])]
    level = rng.choice([0.1, 0.3, 0.6, 0.9])
    for _ in range(80):
        p.observe_calibration([StepRecord(0, 1, [4], [4], [sum(rng.random() < level for _ in range(4))], ["c"], 5,
                                          0, 5, 0.0, 0.0, 0.0)])
    requests = [Request(f"r{i}", list(range(rng.randint(20, 400))), SamplingParams(max_tokens=rng.randint(2, 300)))
                for i in range(rng.randint(1, 40))]
    for r in requests:
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 6)):
                p.acceptance.observe(r.request_id, 4, rng.randint(0, 4))
        if rng.random() < 0.1:
            p.catchup.seen[r.request_id] = r.num_tokens - rng.randint(1, 5)
        if rng.random() < 0.6:
            p.exploration.due_at[r.request_id] = rng.randint(0, 200)
    p.step = rng.randint(1, 100)
    prefilling = [Request("p", list(range(300)), SamplingParams(max_tokens=8))] if rng.random() < 0.3 else []
    v = view(requests, 5, base_tokens=128 * len(prefilling), base_context=20_000 * len(prefilling),
             prefilling=prefilling, now=10.0)
    return p, StepNumbers.of(v, 10.0), p.step


def test_a_plan_surely_without_drafts_is_the_full_plan_cut_short():
    """Where the batch's own estimates show that no plan could pay and no probe is affordable, the full plan stops
    there (GoodputPolicy._plan_of_no_drafts): across random costs, evidence, catch-ups and prefills its answer is the
    full selection's float for float (plan, planned draft lengths, rule, the draft's price check), and it is cut
    short in some of them, not in others."""
    cut = 0
    for seed in range(300):  # in 3 of them the bound holds and a probe runs
        answers = []
        for quick in (True, False):
            p, step, at = random_chain_step(seed)
            early = p._plan_of_no_drafts
            taken = []
            p._plan_of_no_drafts = (lambda *a, early=early, taken=taken: taken.append(early(*a)) or taken[-1]) \
                if quick else (lambda *a: None)
            plan, ks, rule = p._plan_chains(step, at)
            answers.append((plan.ks, plan.predicted_s, plan.probes, ks, rule, p.draft_check.checks, p.shape_probes))
            cut += quick and taken[0] is not None
        assert answers[0] == answers[1], seed
    assert 30 <= cut <= 270


def test_the_rows_due_a_probe_are_those_at_k_0_with_room_whose_probe_is_due():
    """Exploration.due_rows, read over the batch at once, is each request's is_due at k = 0 with room to draft."""
    from smartspec.policy.exploration import Exploration

    rng, explore = random.Random(3), Exploration(4, 0.25, 64, 16)
    ids = tuple(f"r{i}" for i in range(200))
    for rid in ids[::3]:
        explore.due_at[rid] = rng.randint(0, 20)
    ks, caps = [rng.choice([0, 0, 1, 3]) for _ in ids], [rng.choice([0, 2, 5]) for _ in ids]
    for step in (0, 5, 10, 25):
        assert explore.due_rows(ids, ks, caps, step) == [
            i for i, (rid, k, cap) in enumerate(zip(ids, ks, caps)) if k == 0 and cap > 0 and explore.is_due(rid, step)]
    assert explore.due_rows((), [], [], 0) == []


def test_a_probe_runs_only_where_its_outcome_could_make_the_request_draft():
    """Costs fitted on the draft model here: verify flat up to 8 tokens, 0.1 s a draft forward, 4.4 ms a token of
    catch-up; 150-token prompts the draft has not read. Every request has had its drafts rejected, so the plan is
    k = 0 and each is due for a probe (and, the prior not yet learned, catch-up alone would not stop one). Alone,
    a request accepted almost surely would pay for its catch-up and drafts many times over: worth finding out. In
    a batch of 8 the catch-ups and the verify tokens past the flat part cost more than the drafts add, even if all
    eight were accepted almost surely: no outcome pays for it."""
    def choose(batch):
        p = cpu_draft_model_costs(GoodputPolicy(key="t"))
        requests = [Request(f"r{i}", list(range(150)), SamplingParams(max_tokens=64)) for i in range(batch)]
        for r in requests:  # three rejected drafts each: too few outcomes for the prior to count as learned
            for _ in range(3):
                p.acceptance.observe(r.request_id, 4, 0)
        assert p.exploration.learning(p.acceptance.evidence)
        return p.plan(view(requests, 5)), p

    plan, alone = choose(1)
    assert plan.ks == [1] and plan.probes == ["r0"]
    plan, batched = choose(8)
    assert plan.ks == [0] * 8 and not plan.probes
    assert plan.predicted_s == pytest.approx(0.28)


def test_a_learning_probe_runs_only_where_what_it_could_reveal_outweighs_its_cost():
    """Two requests decode beside a prefill, none has drafted, the prior is unlearned and low (two outcomes, every
    draft rejected: drafting does not pay for the batch's mean request, so the next growth of the batch ends it).
    Were the proposer near perfect, the two drafting together would beat plain decoding by a little a step; a probe
    (one request reading its 150-token prompt, 0.66 s, for one outcome) costs more than that little over the two or
    so steps before the next request is expected (arrivals 2 s apart). With arrivals a minute apart, the same edge
    lasts for the catch-up horizon, and the probe runs."""
    def probes(arrival_gap):
        p = cpu_draft_model_costs(GoodputPolicy(key="t"))
        params = SamplingParams(max_tokens=32)
        requests = [Request(f"r{i}", list(range(150)), params, arrival_time=i * arrival_gap) for i in range(2)]
        prefilling = [Request("p", list(range(150)), params, arrival_time=2 * arrival_gap)]
        for _ in range(2):
            p.acceptance.observe("finished", 2, 0)
        assert p.exploration.learning(p.acceptance.evidence)
        assert growths_drafting_lasts(p.acceptance.gains(["r0", "r1"], 5), 2, 300, p.cost, lambda k: k) == 1
        plan = p.plan(view(requests, 5, base_tokens=150, base_context=150, prefilling=prefilling,
                           now=2 * arrival_gap + 0.5))
        assert plan.ks.count(1) == len(plan.probes) and sum(plan.ks) == len(plan.probes)
        return plan.probes

    assert not probes(2.0)
    assert len(probes(60.0)) == 1


def test_a_catch_up_is_priced_over_the_steps_before_the_batch_grows_to_where_drafting_stops():
    """A learned draft model; two requests decode, one of which has read its context, the other not its 300-token
    prompt (1.3 s). Accepted 70% of the time, drafting pays at this batch but stops paying within a few requests
    more (growths_drafting_lasts: 3). Spread over the request's drafting steps, the read pays; over the few steps
    before the batch is expected to have grown that far, when requests arrive every half second and none leaves, it
    does not. In a closed loop at the same rate, where each arrival takes the place of a request that left, the
    batch holds its size and the read pays again. Accepted 99% of the time, drafting pays at every batch size looked
    at, so a growing batch does not end it, and the read pays with the same arrivals."""
    def choose(arrival_gap, closed=False, accepted=140):
        p = cpu_draft_model_costs(GoodputPolicy(key="t"))
        rejected = 200 - accepted
        p.shared.import_state({"key": "t", "prior": {"first": {"accepted": accepted, "rejected": rejected},
                                                     "later": {"accepted": 4 * accepted, "rejected": 4 * rejected}}})
        params = SamplingParams(max_tokens=64)
        earlier = [Request(f"e{i}", [1], params, arrival_time=i * arrival_gap) for i in range(6)]
        for i, r in enumerate(earlier):  # the policy sees each arrive; in the closed loop the one before it left
            if closed and i:
                p.release(earlier[i - 1].request_id)
            p.plan(view([r], 5, now=i * arrival_gap))
        if closed:
            p.release(earlier[-1].request_id)
        seen = Request("seen", list(range(300)), params, arrival_time=6 * arrival_gap)
        p.plan(view([seen], 5, now=6 * arrival_gap))
        fresh = Request("fresh", list(range(300)), params, arrival_time=7 * arrival_gap)
        p.catchup.seen["seen"] = seen.num_tokens - 1
        lasts = growths_drafting_lasts(p.acceptance.gains(["seen", "fresh"], 5), 2, 600, p.cost, lambda k: k)
        return p.plan(view([seen, fresh], 5, now=7 * arrival_gap + 0.1)).ks, lasts

    (sparse, lasts), (dense, _), (closed, _) = choose(60.0), choose(0.5), choose(0.5, closed=True)
    assert lasts == 3
    assert sparse[0] > 0 and sparse[1] > 0
    assert dense[0] > 0 and dense[1] == 0
    assert closed[0] > 0 and closed[1] > 0
    dense, lasts = choose(0.5, accepted=198)
    assert lasts == 1 + 64 and dense[0] > 0 and dense[1] > 0


def test_a_catch_up_beside_a_prefill_is_priced_at_the_decoding_batch_rate():
    """Six requests decode beside a 94-token prefill with a learned, near-perfect draft model; none of them has
    drafted, so each would first read its 97-token context (0.4 s). The catch-ups' seconds are worth what the six
    decoding alone would make of them (about 26 tokens a second), not the prefill step's own rate (about 4 tokens a
    second, its time being the prefill's): priced so, starting them in this step does not pay, while the same batch
    in a step of its own starts, and requests whose context the draft has read draft beside the prefill. (Priced at
    the step's rate, all six started here, and such runs ended 16-19% slower than no speculation.)"""
    def choose(prefill_tokens, seen):
        p = GoodputPolicy(key="t")
        p.cost.v = [0.229, 0.0] + [0.002] * 5 + [0.0]
        p.cost.d = [0.075, 0.0, 0.0041]
        p.shared.import_state({"key": "t", "prior": {"first": {"accepted": 200, "rejected": 4},
                                              "later": {"accepted": 800, "rejected": 16}}})
        params = SamplingParams(max_tokens=32)
        requests = [Request(f"r{i}", list(range(97)), params, arrival_time=5.0 * i) for i in range(6)]
        if seen:
            p.catchup.seen.update({r.request_id: r.num_tokens - 1 for r in requests})
        prefilling = [Request("p", list(range(prefill_tokens)), params, arrival_time=30.0)] if prefill_tokens else []
        return p.plan(view(requests, 5, base_tokens=prefill_tokens, base_context=prefill_tokens, prefilling=prefilling,
                        now=30.5)).ks

    assert choose(0, seen=False) == [5] * 6
    assert choose(94, seen=False) == [0] * 6
    assert min(choose(94, seen=True)) > 0

def quiet_verify(n, c):
    """A CPU-like step: a base cost, a little per token and per token of context."""
    return 0.020 + 0.0015 * n + 2e-6 * c


def quiet_draft(depth, sum_k):
    return 0.0025 * depth + 0.0002 * sum_k


def loaded_verify(n, c):
    return 3 * quiet_verify(n, c)


def loaded_draft(depth, sum_k):
    return 3 * quiet_draft(depth, sum_k)


def goodput_through_a_load(profile_loaded, quiet_steps, loaded_steps=200, b=4, seed=0):
    """A policy profiled (as the engine's warm-up does: batch 1 and 4 at k 0/1/2/5) quiet or under a load that
    makes every step 3x slower, then run loaded_steps steps under the load and quiet_steps quiet ones: b requests
    of 100-token prompts whose drafts are accepted at 0.8 a token, each replaced by a new one after 64 tokens,
    every step 3% noisy. The goodput each quiet step's choice is worth on the quiet machine: tokens expected from
    its drafts over its exact time."""
    rng = random.Random(seed)
    policy = GoodputPolicy(key="t")
    verify, drafting = (loaded_verify, loaded_draft) if profile_loaded else (quiet_verify, quiet_draft)
    policy.observe_profile([StepRecord(0, n, [k] * n, [k] * n, [0] * n, [], n * (k + 1), 0, 64 * n + j,
                                       drafting(k, k * n), verify(n * (k + 1), 64 * n),
                                       verify(n * (k + 1), 64 * n) + drafting(k, k * n))
                            for n in (1, 4) for k in (0, 1, 2, 5) for j in range(2)])
    started = 0

    def new_request():
        nonlocal started
        started += 1
        return Request(f"r{started}", list(range(100)), SamplingParams(max_tokens=64))

    requests = [new_request() for _ in range(b)]
    chosen = []
    for step in range(loaded_steps + quiet_steps):
        verify, drafting = (loaded_verify, loaded_draft) if step < loaded_steps else (quiet_verify, quiet_draft)
        ks = policy.plan(view(requests, 6)).ks
        accepted = []
        for k in ks:
            accepted.append(0)
            while accepted[-1] < k and rng.random() < 0.8:
                accepted[-1] += 1
        n, c = b + sum(ks), sum(r.num_tokens for r in requests) + sum(ks)
        draft_s = drafting(max(ks), sum(ks)) * rng.uniform(0.97, 1.03) if max(ks) else 0.0
        verify_s = verify(n, c) * rng.uniform(0.97, 1.03)
        policy.observe(StepRecord(step, b, ks, ks, accepted, [r.request_id for r in requests], n, 0, c, draft_s,
                                  verify_s, verify_s + draft_s, num_tokens=[r.num_tokens for r in requests]))
        for i, r in enumerate(requests):
            r.token_ids += [0] * (1 + accepted[i])
            if r.num_output_tokens >= r.params.max_tokens:
                policy.release(r.request_id)
                requests[i] = new_request()
        if step >= loaded_steps:
            tokens = sum((1 - 0.8 ** (k + 1)) / 0.2 for k in ks)
            chosen.append(tokens / (quiet_verify(n, c) + (quiet_draft(max(ks), sum(ks)) if max(ks) else 0.0)))
    return chosen


@pytest.mark.parametrize("profile_loaded", [False, True], ids=["profiled quiet", "profiled under the load"])
def test_a_fit_made_under_a_passing_load_returns_to_the_quiet_choice(profile_loaded):
    """A replica restarted on a loaded box profiles and runs its first steps 3x slower; the load passes. Its cost
    fit mixed the loaded past with the quiet present, told apart only by the shapes each ran: drafts that ran under
    the load looked dear, the policy left them (k = 0 for a hundred steps and more), or ran only what looked cheap
    (k = 6). From 100 quiet steps on, the policy's choices are worth what those of one that never saw the load are:
    judged on goodput, since k = 2 and k = 3 are worth within 1% of each other here and either is a fair choice."""
    quiet = np.mean(goodput_through_a_load(False, 400, loaded_steps=0)[100:])
    no_drafts = 4 / (quiet_verify(4, 4 * 130))
    assert quiet > 1.3 * no_drafts  # drafting pays on the quiet machine
    after = goodput_through_a_load(profile_loaded, 500)[100:]
    windows = [np.mean(after[i:i + 25]) / quiet for i in range(0, len(after), 25)]
    assert np.mean(after) > 0.98 * quiet and min(windows) > 0.95, (quiet, windows)


def test_state_export_merge_import():
    a, b = GoodputPolicy(key="ngram"), GoodputPolicy(key="ngram")
    for _ in range(40):
        a.acceptance.observe("x", 4, 4)
        b.acceptance.observe("y", 4, 0)
    for n in (1, 2, 4, 8, 16):
        a.cost.observe(n, 100, 0, 0, 0.0, true_verify(n, 100))
        b.cost.observe(n, 100, 0, 0, 0.0, 2 * true_verify(n, 100))
    merged = merge_states([a.shared.export_state(), b.shared.export_state(), {"key": "draft_model:x", "prior": {
        "first": {"accepted": 1e6, "rejected": 0}}, "cost": {}}])
    assert merged["replicas"] == 2  # another proposer's evidence is not mixed in
    fresh = GoodputPolicy(key="ngram")
    fresh.shared.import_state(merged)
    assert a.acceptance.first.prior > fresh.acceptance.first.prior > b.acceptance.first.prior
    assert fresh.cost.predict_verify(4, 100) == pytest.approx(1.5 * true_verify(4, 100), rel=0.02)


PROMPTS = ["abcabcabcabc abc", "def f(x): return x\ndef g(x): return x\ndef", "xyz " * 8, "hello world"]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix", ["draft_model", "suffix"]])
def test_engine_under_smartspec_equals_off(method, tiny_qwen, tiny_qwen_draft, tmp_path):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25, 33, 12)]
    spec = {"method": method, "num_speculative_tokens": 4, "policy": "smartspec"}
    if "draft_model" in method:
        spec["model"] = tiny_qwen_draft
    trace = tmp_path / "trace.parquet"
    llm = LLM(tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec,
              trace_path=str(trace))
    policy = llm.engine.speculation.policy
    assert isinstance(policy, GoodputPolicy) and policy.cost.ready  # seeded by the warm-up profile
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


def test_on_a_padded_runner_one_request_does_not_widen_every_row():
    """Steps padded to buckets (CUDA graphs) cost their cells: a chain of 5 for one request of 64 makes every row 8
    wide. Where a cell costs what a token costs, the plan that pays on real tokens (k = 5 for the one request that
    accepts everything) is not chosen once the view says how steps are padded."""
    from smartspec.types.padding import PaddedShapes

    def plan(shapes):
        p = drafting_policy(0.0)
        p.cost.v = [0.005] + [2e-6] * 6 + [0.0]  # 5 ms a step, 2 us a token (or a padded cell)
        p.cost.d = [1e-5, 1e-6, 0.0]  # drafts all but free
        requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=64)) for i in range(64)]
        for _ in range(30):
            p.acceptance.observe("r0", 5, 5)
            for r in requests[1:]:
                p.acceptance.observe(r.request_id, 5, 0)
        return p.plan(dataclasses.replace(view(requests, 5), shapes=shapes)).ks

    assert plan(None)[0] == 5  # on real tokens the long chain pays
    padded = plan(PaddedShapes(rows=(1, 2, 4, 8, 16, 32, 64), widths=(1, 2, 4, 8), max_cells=512))
    assert max(padded) <= 1  # no row wider than 2: 128 cells, not 512


def test_the_engine_counts_the_policys_own_host_time(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """The engine's step totals carry the seconds its policy planned and observed (steps' policy_ms_per_step): a
    policy made 5 ms slower in each is reported at least that much slower, and the two parts sum to the total."""
    spec = {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 3, "policy": "smartspec"}
    llm = LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_model_len=256, speculative_config=spec)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    quick = llm.engine.stats.snapshot()
    assert quick.steps > 0 and 0 < quick.policy_ms_per_step == 1e3 * llm.engine.stats.policy_s / quick.steps
    policy = llm.engine.speculation.policy
    import time as clock

    for name in ("plan", "observe"):
        monkeypatch.setattr(policy, name, lambda arg, f=getattr(policy, name): (clock.sleep(0.005), f(arg))[1])
    steps, spent = llm.engine.stats.steps, llm.engine.stats.policy_s
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    slow = (llm.engine.stats.policy_s - spent) / (llm.engine.stats.steps - steps)
    assert slow >= 0.010
    llm.engine.close()


def test_a_few_rows_caps_are_those_numpy_gives_a_batch(monkeypatch):
    """StepNumbers.caps reads a small batch's caps in Python and a larger one's in numpy: the same caps either way,
    for requests with and without a cap of their own (and batches where none has one), near their last token and far
    from it."""
    import smartspec.policy.step_numbers as step_numbers
    from smartspec.types.plan import RequestView, StepView

    rng = np.random.default_rng(3)
    for rows in (1, 2, 5, 16, 17, 40):
        for attempt in range(30):
            uncapped = 1.0 if attempt % 3 == 0 else 0.5  # a third of the batches: no request with a cap of its own
            k_max = int(rng.integers(0, 9))
            views = []
            for i in range(rows):
                max_tokens = int(rng.integers(1, 40))
                output = int(rng.integers(0, max_tokens + 1))
                own = None if rng.random() < uncapped else int(rng.integers(0, 9))
                views.append(RequestView(f"r{i}", 10 + output, output, max_tokens, own, 0.0))
            caps = StepNumbers.of(StepView(views, k_max), 0.0).caps
            expected = [max(0, min(v.max_tokens - v.num_output_tokens - 1, k_max,
                                   v.k_cap if v.k_cap is not None else k_max)) for v in views]
            assert caps == expected
            for threshold in (0, 10 ** 6):  # numpy for every batch, then Python for every batch
                monkeypatch.setattr(step_numbers, "_FEW_ROWS", threshold)
                assert StepNumbers.of(StepView(views, k_max), 0.0).caps == expected
            monkeypatch.undo()
