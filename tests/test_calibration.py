"""The start's acceptance calibration (engine/profile.py): the draft model tried on a little real text before any
request, its outcomes the first evidence of the goodput policy's acceptance prior."""
import json

import pytest

from policy_views import view

from smartspec import LLM, SamplingParams
from smartspec.engine import llm_engine, profile, profile_cache
from smartspec.policy.goodput_policy import GoodputPolicy
from smartspec.types.request import Request
from smartspec.types.step_record import StepRecord

OPTIONS = dict(num_kv_blocks=256, block_size=4, max_model_len=256)


def _engine(model, draft, **options):
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "policy": "smartspec"}
    return LLM(model, speculative_config=spec, **OPTIONS, **options).engine


def test_a_draft_that_is_the_target_starts_near_certain_and_an_unrelated_one_below_the_guess(tiny_qwen,
                                                                                              tiny_qwen_draft):
    """The target as its own draft: greedy drafts are always accepted; an unrelated random draft's almost never.
    The calibration measures which, where an uncalibrated policy starts both at the guess of 0.5."""
    same = _engine(tiny_qwen, tiny_qwen).speculation.policy.acceptance
    other = _engine(tiny_qwen, tiny_qwen_draft).speculation.policy.acceptance
    guessed = _engine(tiny_qwen, tiny_qwen, warmup_profile=False).speculation.policy.acceptance
    assert guessed.first.prior == 0.5 and guessed.evidence == 0
    assert same.evidence > 10 and other.evidence > 10
    assert same.first.prior > 0.8 and same.later.prior > 0.8
    assert other.first.prior < 0.5


def _profiled_policy() -> GoodputPolicy:
    """A policy whose warm-up profile (batch 1 and 4 at k 0/1/2/3) measured a draft token at half a target step, as
    the default pair's on a bandwidth-bound CPU: at the starting guess of 0.5, drafting does not pay."""
    def verify(n, c):
        return 0.040 + 0.004 * n + 1e-6 * c

    def draft(depth, sum_k):
        return 0.022 * depth + 0.001 * sum_k
    policy = GoodputPolicy(key="t")
    policy.observe_profile([StepRecord(0, n, [k] * n, [k] * n, [0] * n, [], n * (k + 1), 0, 64 * n + j,
                                       draft(k, k * n), verify(n * (k + 1), 64 * n),
                                       verify(n * (k + 1), 64 * n) + draft(k, k * n))
                            for n in (1, 4) for k in (0, 1, 2, 3) for j in range(2)])
    return policy


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_calibrated_policy_drafts_from_the_first_step_of_the_first_request(calibrated):
    """At the guess of 0.5 the first request's first step does not choose to draft: it probes (k = 1), and would
    learn the draft's worth only through probes; calibration outcomes that say the draft is accepted (48 drafts of
    3, all accepted) make that step choose k = 3, no probe."""
    policy = _profiled_policy()
    if calibrated:
        policy.observe_calibration([StepRecord(i, 2, [3, 3], [3, 3], [3, 3], ["c0", "c1"], 8, 0, 100, 0.1, 0.1, 0.2)
                                    for i in range(24)])
    request = Request("r0", list(range(40)), SamplingParams(max_tokens=64))
    plan = policy.plan(view([request], 3))
    chosen = [k for k, r in zip(plan.ks, [request.request_id]) if r not in plan.probes]  # a probe is not a choice
    assert chosen == ([3] if calibrated else []) and (plan.probes == []) == calibrated, plan


def test_lookups_are_not_calibrated(tiny_qwen):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "smartspec"}
    engine = LLM(tiny_qwen, speculative_config=spec, **OPTIONS).engine
    assert engine.speculation.policy.acceptance.evidence == 0
    assert profile.calibrate_acceptance(engine) == []


def test_a_kept_calibration_is_taken_again_without_measuring(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setattr(profile_cache, "cache_root", lambda: tmp_path)
    first = _engine(tiny_qwen, tiny_qwen, profile_cache=True).speculation.policy.acceptance
    (kept,) = (tmp_path / "profiles").glob("*.json")
    assert json.loads(kept.read_text())["calibration"]
    with monkeypatch.context() as patched:
        patched.setattr(profile, "calibrate_acceptance", lambda engine: pytest.fail("calibrated again"))
        patched.setattr(llm_engine.LLMEngine, "profile_steps", lambda self, *a: pytest.fail("measured again"))
        second = _engine(tiny_qwen, tiny_qwen, profile_cache=True).speculation.policy.acceptance
    assert second.export_counts() == first.export_counts()
