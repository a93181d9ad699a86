"""What the engine reports to its replica and to the offline API: typed objects (types/snapshot.py,
types/metrics.py), copies that later steps leave alone, and the /status JSON made from them."""
import json

from smartspec import LLM, SamplingParams
from smartspec.types.metrics import RequestMetrics, SpecDecodeMetrics
from smartspec.types.snapshot import EngineSnapshot, LoadCosts, StepTotals

STATUS_KEYS = {"running", "waiting", "free_blocks", "total_blocks", "max_num_seqs", "policy_name", "prefix_cache",
               "spec_decode", "steps", "draft_available", "draft_failures", "draft_incarnation", "policy_state",
               "request_speed", "prefill_s_per_token"}


def test_the_engine_reports_typed_copies_and_its_status_json(tiny_qwen):
    llm = LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"})
    outs = llm.generate(["abcabcabcabc abc", "hello"], SamplingParams(max_tokens=24, ignore_eos=True))
    engine = llm.engine
    snap = engine.snapshot()
    assert isinstance(snap, EngineSnapshot) and isinstance(snap.steps, StepTotals)
    assert isinstance(snap.spec_decode, SpecDecodeMetrics) and isinstance(snap.load, LoadCosts)
    assert (snap.running, snap.waiting, snap.free_blocks, snap.total_blocks) == (0, 0, 64, 64)
    # a proposer is configured, without a draft model (prompt lookup); a policy without shared state
    assert snap.draft is not None and snap.draft.available is False and snap.policy_name == "fixed"
    assert snap.policy_state is None
    assert snap.steps.steps > 0 and sum(snap.steps.chosen_k.values()) > 0
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted > 0 and snap.spec_decode.num_draft_tokens == drafted  # the requests' counters add up
    status = snap.as_dict()
    assert set(status) == STATUS_KEYS and json.loads(json.dumps(status))["running"] == 0  # plain JSON values
    assert status["steps"]["steps"] == snap.steps.steps and "policy_state" not in snap.as_dict(False)
    # copies: more steps change the engine's totals, not what was reported
    steps, tokens = snap.steps.steps, snap.spec_decode.num_draft_tokens
    llm.generate(["abcabcabcabc abc"], SamplingParams(max_tokens=24, ignore_eos=True))
    assert (snap.steps.steps, snap.spec_decode.num_draft_tokens) == (steps, tokens)
    assert engine.stats.steps > steps and engine.speculation.metrics.num_draft_tokens > tokens


def test_a_request_output_carries_its_own_times_and_counters(tiny_qwen):
    llm = LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"})
    engine = llm.engine
    engine.add_request("abcabcabcabc abc", SamplingParams(max_tokens=16, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    first, last = seen[0].metrics, seen[-1].metrics
    assert isinstance(last, RequestMetrics) and last.finish_time is not None and first.finish_time is None
    assert last.first_token_time >= last.arrival_time and last.spec_decode.num_draft_tokens > 0
    assert first.spec_decode.num_draft_tokens <= last.spec_decode.num_draft_tokens  # each output its own copy
    assert first.spec_decode is not last.spec_decode
