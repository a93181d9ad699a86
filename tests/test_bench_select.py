"""scripts/bench_select.py's replay: the policy's calls kept as an engine makes them and made again on a fresh policy
do the same work (the figure it gives is a timing, which no test reads)."""
import random
import sys
from pathlib import Path

from costs import draft_cost, true_verify
from policy_views import view

from smartspec import SamplingParams
from smartspec.types.request import Request
from smartspec.types.step_record import StepRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_select  # noqa: E402


def test_a_kept_view_reads_its_columns_when_kept_not_when_the_requests_have_moved_on():
    requests = [Request(f"r{i}", list(range(10 + i)), SamplingParams(max_tokens=50 + i)) for i in range(3)]
    live = view(requests, 5, draft_held={"r1": 7})
    kept = bench_select.kept_view(live)
    for r in requests:
        r.token_ids += [1, 2]
    assert kept.requests.ids == ("r0", "r1", "r2") and kept.requests.num_tokens == [10, 11, 12]
    assert [v.num_output_tokens for v in kept.requests] == [0, 0, 0]
    assert list(kept.requests.draft_held) == [0, 7, 0] and kept.now is not None


def test_replayed_calls_leave_a_fresh_policy_as_the_engine_left_its_own():
    """A batch whose requests accept at rates of their own, steps timed by a cost surface, requests finishing and
    joining: the recorded policy and the one the replay leaves have planned and learned alike."""
    rng, recorded = random.Random(5), bench_select.RecordedPolicy()
    requests = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=rng.randint(20, 60))) for i in range(6)]
    rate = {r.request_id: rng.uniform(0.2, 0.95) for r in requests}
    plans = []
    for step in range(1, 120):
        if not requests:
            break
        plan = recorded.plan(view(requests, 4, now=0.05 * step))
        plans.append(plan.ks)
        accepted = [sum(1 for _ in range(k) if rng.random() < rate[r.request_id]) for r, k in zip(requests, plan.ks)]
        n, c = len(requests) + sum(plan.ks), sum(r.num_tokens for r in requests) + sum(plan.ks)
        drafting = draft_cost(max(plan.ks), sum(plan.ks))
        recorded.observe(StepRecord(step, len(requests), plan.ks, plan.ks, accepted, [r.request_id for r in requests],
                                    n, 0, c, drafting, true_verify(n, c), true_verify(n, c) + drafting,
                                    probes=plan.probes, num_tokens=[r.num_tokens for r in requests]))
        for r, a in zip(requests, accepted):
            r.token_ids += [1] * (a + 1)
        for r in [r for r in requests if r.num_tokens - 100 >= r.params.max_tokens]:
            requests.remove(r)
            recorded.release(r.request_id)
    assert any(map(any, plans))  # it drafted: the replay is not of plain decoding alone
    ms_per_step, fresh = bench_select.replayed(recorded.calls)
    assert ms_per_step > 0
    assert fresh.stats() == recorded.stats() and fresh.step == recorded.step
