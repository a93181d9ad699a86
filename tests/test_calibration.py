"""The start's acceptance calibration (engine/profile.py): the draft model tried on a little real text before any
request, its outcomes the first evidence of the goodput policy's acceptance prior; suffix lookups replayed along the
same answers, the first evidence of its node calibration."""
import json

import pytest

from policy_views import view

from smartspec import LLM, SamplingParams
from smartspec.engine import llm_engine, profile, profile_cache
from smartspec.policy.goodput_policy import GoodputPolicy
from smartspec.spec_decode.suffix import SuffixProposer
from smartspec.types.request import Request
from smartspec.types.step_record import StepRecord
from smartspec.types.tree import TokenTree

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


def test_prompt_lookup_is_not_calibrated(tiny_qwen):
    """N-gram trees offer no lookups before planning: nothing to replay, and no draft model to calibrate."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "smartspec"}
    engine = LLM(tiny_qwen, speculative_config=spec, **OPTIONS).engine
    assert engine.speculation.policy.acceptance.evidence == 0
    assert engine.speculation.policy.calibration.total.sum() == 0
    assert profile.calibrate_acceptance(engine) == ([], [])


def test_suffix_lookups_start_calibrated_along_the_same_answers_with_or_without_a_draft(tiny_qwen, tiny_qwen_draft):
    """The calibration answers are greedy, so the same whether the draft model drafted them or plain decoding wrote
    them: the lookups replayed along them give the node calibration the same first evidence either way."""
    calibrations = []
    for method in (["draft_model", "suffix"], "suffix"):
        spec = {"method": method, "model": tiny_qwen_draft, "num_speculative_tokens": 3, "policy": "smartspec"}
        engine = LLM(tiny_qwen, speculative_config=spec, **OPTIONS).engine
        calibrations.append(engine.speculation.policy.calibration)
        assert engine.speculation.proposer.lookups([], 3) == []  # the serving proposer holds nothing of the replay
        assert (engine.speculation.policy.acceptance.evidence > 0) == (method != "suffix")
    mixed, suffix = calibrations
    assert mixed.total.sum() > 10  # a random tiny model repeats itself: its answers hold matches
    assert mixed.accepted.tolist() == suffix.accepted.tolist() and mixed.total.tolist() == suffix.total.tolist()


@pytest.mark.parametrize("method", ["draft_model", ["draft_model", "suffix"]])
def test_a_kept_calibration_is_taken_again_without_measuring(method, tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setattr(profile_cache, "cache_root", lambda: tmp_path)
    spec = {"method": method, "model": tiny_qwen, "num_speculative_tokens": 3, "policy": "smartspec"}

    def start():
        return LLM(tiny_qwen, speculative_config=spec, profile_cache=True, **OPTIONS).engine.speculation.policy
    first = start()
    (kept,) = (tmp_path / "profiles").glob("*.json")
    assert json.loads(kept.read_text())["calibration"] and json.loads(kept.read_text())["answers"]
    with monkeypatch.context() as patched:
        patched.setattr(profile, "calibrate_acceptance", lambda engine: pytest.fail("calibrated again"))
        patched.setattr(llm_engine.LLMEngine, "profile_steps", lambda self, *a: pytest.fail("measured again"))
        second = start()
    assert second.acceptance.export_counts() == first.acceptance.export_counts()
    assert second.calibration.export_state() == first.calibration.export_state()
    assert (first.calibration.total.sum() > 0) == (method != "draft_model")


def test_replayed_lookups_walk_each_answer_through_the_tree_offered_before_it():
    """Prompt 10..29; the answer copies its start, then strays at the fourth token. Each position's lookup (depth 3)
    and the path the answer takes through it, as greedy verification would accept it."""
    lookup = SuffixProposer(max_depth=3)
    prompt, answer = list(range(10, 30)), [10, 11, 12, 40, 41, 42, 43, 44]
    replayed = lookup.replayed_lookups([(prompt, answer)], budget=3)
    # after "10": 11 12 13 offered, 11 12 met; after "10 11": 12 13 14, 12 met; after "10 11 12": 13 14 15, none
    assert [(t.tokens, path) for t, path in replayed] == [([11, 12, 13], [0, 1]), ([12, 13, 14], [0]),
                                                         ([13, 14, 15], [])]
    assert lookup.local == {} and lookup.finished.num_tokens == 0  # the proposer replaying is left as it was


def test_a_later_answer_is_replayed_against_the_answers_before_it():
    """As in serving, each replayed answer goes to the finished-output cache: a second question whose prompt shares
    nothing with the first, answered the same way, is drafted from the first answer, every node accepted."""
    lookup = SuffixProposer(max_depth=3)
    answer = list(range(10, 22))
    first = lookup.replayed_lookups([(list(range(60, 80)), answer)], budget=3)
    both = lookup.replayed_lookups([(list(range(60, 80)), answer), (list(range(100, 120)), answer)], budget=3)
    second = both[len(first):]
    assert len(second) == len(answer) - 3  # every position but the first (its context ends in the new prompt)
    assert all(t.tokens == answer[j + 1:j + 4] and path == [0, 1, 2] for j, (t, path) in enumerate(second))


def test_replayed_lookups_that_were_not_accepted_make_the_first_requests_prefer_the_draft():
    """Lookups confident at 0.9 that the calibration answers rejected: the first request's step no longer takes the
    lookup's word for it."""
    def first_plan(policy):
        policy.cost.v = [0.020, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.0]
        request = Request("r0", list(range(40)), SamplingParams(max_tokens=64))
        return policy.plan(view([request], 4, lookups=[TokenTree.chain([1, 2, 3, 4], [0.9] * 4)], use_draft=False))
    assert first_plan(GoodputPolicy(key="t")).ks == [4]
    calibrated = GoodputPolicy(key="t")
    calibrated.observe_lookup_calibration([(TokenTree.chain([1, 2, 3, 4], [0.9] * 4), [0] if i % 5 == 0 else [])
                                           for i in range(200)])
    assert calibrated.calibration.probability(0.9) == pytest.approx(1 / 6, abs=0.02)  # 40 of 240 nodes tried
    assert first_plan(calibrated).ks[0] <= 1


def recorded_steps(monkeypatch) -> list[StepRecord]:
    """The records of every step an engine runs from here on, the unobserved ones (warm-up, profile) included."""
    steps = []
    real_step = llm_engine.LLMEngine.run_step

    def run_step(self, speculation, step_number=0):
        result = real_step(self, speculation, step_number)
        if result.record is not None:
            steps.append(result.record)
        return result
    monkeypatch.setattr(llm_engine.LLMEngine, "run_step", run_step)
    return steps


def test_a_start_from_a_kept_profile_warms_both_models_up_and_observes_nothing(tiny_qwen, tmp_path, monkeypatch):
    """A kept profile runs no forward at start; a model's first forwards in a process cost several times the next
    ones, and the first request would teach the cost fit that. One short request drafts through both models at
    start instead, seen by no one: not the policy, not the lookups' cache."""
    monkeypatch.setattr(profile_cache, "cache_root", lambda: tmp_path)
    spec = {"method": ["draft_model", "suffix"], "model": tiny_qwen, "num_speculative_tokens": 3, "policy": "smartspec"}

    def start():
        return LLM(tiny_qwen, speculative_config=spec, profile_cache=True, **OPTIONS).engine
    measured = start()
    records = recorded_steps(monkeypatch)
    kept = start()
    assert records and all(rid.startswith("__warm-up-") for r in records for rid in r.request_ids)
    assert any(r.draft_s > 0 and max(r.proposed, default=0) == 3 for r in records)  # the draft ran a full-k step
    assert not kept.has_unfinished() and kept.speculation.proposer.lookup.finished.num_tokens == 0
    assert len(kept.speculation.policy.cost.verify_samples) == len(measured.speculation.policy.cost.verify_samples)
    assert kept.speculation.policy.step == measured.speculation.policy.step == 0


def test_a_measured_profile_times_no_model_s_first_forward(tiny_qwen, tmp_path, monkeypatch):
    """A model's first forwards in a process cost several times the next ones; the default pair's first profiled
    drafting step took 0.37-0.42 s where the same step takes 0.14 s warm, and the fit priced a draft forward at 24
    ms where it costs 17. The warm-up request runs through both models before the profile's first step."""
    monkeypatch.setattr(profile_cache, "cache_root", lambda: tmp_path)
    spec = {"method": ["draft_model", "suffix"], "model": tiny_qwen, "num_speculative_tokens": 3, "policy": "smartspec"}
    steps = recorded_steps(monkeypatch)
    engine = LLM(tiny_qwen, speculative_config=spec, profile_cache=True, **OPTIONS).engine
    first_profiled = next(i for i, r in enumerate(steps) if any(rid.startswith("__profile-") for rid in r.request_ids))
    warm_up = steps[:first_profiled]
    assert warm_up and all(rid.startswith("__warm-up-") for r in warm_up for rid in r.request_ids)
    assert any(r.draft_s > 0 and max(r.proposed, default=0) == 3 for r in warm_up)  # the draft ran a full-k step
    assert not engine.has_unfinished() and engine.speculation.policy.step == 0
