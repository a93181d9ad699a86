"""Speculative decoding is lossless: greedy output equals non-speculative output token for token (the kernels are
batch-invariant, so this is asserted bitwise, without a near-tie allowance)."""
import pytest
from engines import PARAMS, PROMPTS, AlternatingPolicy, MixedPolicy, StepPolicy, make, run_staggered
from lossless import token_logprob

from smartspec import LLM, SamplingParams
from smartspec.spec_decode.ngram import lookup

@pytest.fixture(scope="module")
def plain_outputs(tiny_qwen):
    return [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix", ["draft_model", "suffix"]])
def test_greedy_speculation_equals_plain_in_mixed_batches(method, tiny_qwen, tiny_qwen_draft, plain_outputs,
                                                          tmp_path):
    spec = {"method": method, "num_speculative_tokens": 4, "policy": MixedPolicy()}
    if "draft_model" in method:
        spec["model"] = tiny_qwen_draft
    llm = make(tiny_qwen, spec, trace_path=str(tmp_path / "steps.parquet"))
    drew, chosen = [], []  # (proposer, tokens proposed) per request and step; the proposers of each step

    def observe(rec):
        methods = dict(zip(rec.request_ids, rec.methods)) if rec.methods is not None else {}
        chosen.append(list(rec.methods or []))
        drew.extend((methods.get(rid, method), p) for rid, p in zip(rec.request_ids, rec.proposed))

    llm.engine.speculation.policy.observe = observe
    assert run_staggered(llm, PROMPTS, PARAMS) == plain_outputs
    llm.engine.trace.close()
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "steps.parquet")["methods"].to_pylist() == chosen  # the trace names them
    m = llm.engine.speculation.metrics
    # the test must exercise both outcomes: accepted drafts and rejected ones
    assert m.num_accepted_tokens > 0 and m.num_accepted_tokens < m.num_draft_tokens, m
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    proposer = llm.engine.speculation.proposer
    if isinstance(method, list):  # both proposers drafted, in shared steps
        assert {m for m, p in drew if p} == set(method), drew
        proposer = proposer.draft
    if "draft_model" in method:
        assert proposer.blocks.num_free == proposer.blocks.num_blocks and not proposer.state


def test_self_draft_accepts_everything(tiny_qwen, plain_outputs):
    k = 3
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen, "num_speculative_tokens": k, "policy": "fixed"})
    # 1 token from the prefill, then m full steps of k + 1: no step is cut short by max_tokens
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1 + (k + 1) * 9, ignore_eos=True))[0]
    m = llm.engine.speculation.metrics
    assert m.acceptance_rate == 1.0
    assert m.mean_acceptance_length == k + 1
    assert m.num_drafts == 9 and m.accepted_per_position == [9] * k
    assert out.token_ids == make(tiny_qwen).generate(PROMPTS[0], SamplingParams(max_tokens=37, ignore_eos=True))[0].token_ids


def test_draft_catches_up_after_k0_steps(tiny_qwen, plain_outputs):
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen, "num_speculative_tokens": 3,
                           "policy": AlternatingPolicy()})
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain_outputs
    # a self-draft that missed the tokens made at k = 0 would disagree with the target
    assert llm.engine.speculation.metrics.acceptance_rate == 1.0
    assert llm.engine.speculation.metrics.num_drafts > 10


def test_stops_inside_an_accepted_run(tiny_qwen, plain_outputs):
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen, "num_speculative_tokens": 4, "policy": "fixed"})
    base = plain_outputs[0]
    stop_tok = base[6]
    first = base.index(stop_tok)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[:first + 1]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=7, ignore_eos=True))[0]  # 7 = 1 + 4 + 2: mid-run
    assert out.finish_reason == "length" and out.token_ids == base[:7]
    plain_text = make(tiny_qwen).generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    needle = plain_text[8:10]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, stop=[needle], ignore_eos=True))[0]
    assert out.text == plain_text[: plain_text.index(needle)]
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_failing_proposer_degrades_to_plain_decoding(tiny_qwen, plain_outputs):
    llm = make(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 4})

    def broken(requests, ks):
        raise RuntimeError("draft actor died")

    llm.engine.speculation.proposer.propose = broken
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain_outputs
    assert llm.engine.speculation.metrics.num_drafts == 0


def test_failing_policy_degrades_to_plain_decoding(tiny_qwen, plain_outputs):
    def broken(step, i, k_max):
        raise RuntimeError("policy bug")

    for policy in (StepPolicy(broken), StepPolicy(lambda step, i, k_max: k_max + 7)):  # raises / out of range
        llm = make(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 4, "policy": policy})
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain_outputs
        assert llm.engine.speculation.metrics.num_drafts == 0


def test_policy_off_never_drafts(tiny_qwen, tiny_qwen_draft, plain_outputs):
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen_draft, "policy": "off"})
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain_outputs
    assert llm.engine.speculation.metrics.num_drafts == 0 and not llm.engine.speculation.proposer.state


@pytest.mark.parametrize("tree", [None, {"max_nodes": 8, "max_depth": 3, "branching": 2}])
def test_sampled_speculation_is_seeded_and_valid(tiny_qwen, tiny_qwen_draft, tree):
    # a fixed k: smartspec's k follows measured step times, and how many random draws a step takes follows k
    spec = {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 3, "tree": tree,
            "policy": "fixed"}
    p = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    a = make(tiny_qwen, spec).generate(PROMPTS, p)
    b = make(tiny_qwen, spec).generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 30 for o in a)


@pytest.mark.parametrize("bad,message", [
    ({"method": "medusa"}, "method"), ({"method": "draft_model", "model": None}, "needs speculation.model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "policy": "sometimes"}, "unknown policy"), ({"method": "ngram", "k": 3}, "unknown"),
])
def test_bad_speculative_config_is_rejected(tiny_qwen, bad, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_qwen, bad)


def test_set_speculation_takes_a_policy_instance_not_a_name(tiny_qwen):
    """A name would be rebuilt without the config's table, options, prior key and tree depth: refused."""
    llm = make(tiny_qwen, {"method": "ngram"})
    with pytest.raises(TypeError, match="Policy instance"):
        llm.engine.set_speculation(policy="off")


def test_draft_with_another_tokenizer_is_rejected(tiny_qwen, smollm):
    with pytest.raises(ValueError, match="tokenizer"):
        make(tiny_qwen, {"method": "draft_model", "model": smollm})


def test_ngram_lookup_all_is_every_earlier_occurrence_most_recent_first():
    """lookup_all searches the context's bytes: the same continuations, in the same order, as scanning every earlier
    position, over contexts with many occurrences and tokens whose bytes overlap their neighbours' (> 255)."""
    import random

    from smartspec.spec_decode.ngram import lookup_all

    def scanned(tokens, depth, n_max, n_min, max_matches):
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            suffix = tokens[len(tokens) - n:]
            found = [tokens[s + n:s + n + depth] for s in range(len(tokens) - n - 1, -1, -1)
                     if tokens[s:s + n] == suffix][:max_matches]
            if found:
                return found
        return []

    rng = random.Random(0)
    for case in range(3000):
        alphabet = rng.choice([[1, 2], [0, 1, 2, 3], [256, 1, 65536, 257, 16777216], list(range(300))])
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 60))]
        depth, n_max, n_min = rng.randrange(1, 6), rng.randrange(1, 5), rng.choice([1, 2])
        args = (depth, max(n_max, n_min), n_min, rng.choice([1, 3, 16]))
        assert lookup_all(tokens, *args) == scanned(tokens, *args), (case, tokens, args)


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2, 3], 2, 3, 1) == [9, 1]
    assert lookup([1, 2, 3, 9, 1, 2, 3], 5, 3, 1) == [9, 1, 2, 3]
    assert lookup([5, 1, 7, 1, 8, 1], 1, 3, 1) == [8]  # the most recent match of the suffix [1]
    assert lookup([1, 2, 3, 4], 3, 3, 1) == []
    assert lookup([4, 2, 4], 3, 3, 2) == []  # no match of length >= 2


@pytest.mark.real_model
def test_real_qwen_pair_greedy_speculation_equals_plain():
    """The default pair: Qwen2.5-Coder-1.5B verified against drafts from the 0.5B at a fixed k = 4 (the goodput
    policy may rightly choose k = 0 everywhere on a CPU where the draft does not pay, and a lossless test must
    not hang on the machine's step costs), in one engine; policy "off" (the draft never runs) is the
    non-speculative reference. Logprobs too: equal greedy; sampled, the target's over the final sequence."""
    from smartspec.models import fetch
    from smartspec.policy import FixedPolicy, OffPolicy
    from smartspec.spec_decode.ngram import NgramTreeProposer

    target, draft = str(fetch("qwen2.5-coder-1.5b")), str(fetch("qwen2.5-coder-0.5b"))
    llm = LLM(target, kv_cache_gib=0.5, max_model_len=1024, max_num_seqs=4,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                                  "policy": "fixed"})
    chat = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                              add_generation_prompt=True)
            for c in ("Write a Python function is_palindrome(s).", "Explain what a mutex is in one sentence.")]
    prompts = chat + ["def fibonacci(n):\n    "]
    params = SamplingParams(max_tokens=24, logprobs=2)
    spec = llm.generate(prompts, params)
    m = llm.engine.speculation.metrics
    sampled = llm.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0.8, seed=5, logprobs=1))
    draft = llm.engine.speculation.proposer
    llm.engine.set_speculation(proposer=NgramTreeProposer(3, 2), policy=FixedPolicy(6), k_max=6)
    tree = llm.generate(prompts, params)
    assert llm.engine.speculation.metrics.num_accepted_tokens > 0
    llm.engine.set_speculation(proposer=draft, policy=OffPolicy(), k_max=4)
    plain = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain] == [o.token_ids for o in tree]
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0
    # logprobs: the same bits with and without speculation (chain and tree); sampled, each the target's over the
    # final sequence
    assert [o.logprobs for o in spec] == [o.logprobs for o in plain] == [o.logprobs for o in tree]
    for out in sampled:
        ids = out.prompt_token_ids + out.token_ids
        scored = llm.engine.runner.score(ids)
        n = len(out.prompt_token_ids)
        assert out.logprobs == [token_logprob(scored[n + i - 1], t, 1) for i, t in enumerate(out.token_ids)]
