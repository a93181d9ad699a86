"""Suffix speculation and the proposer chosen per request: the lookups, their trees and counts, the bounded cache of
finished outputs, the goodput choice between draft model and lookups, and the engine lossless under both (greedy
bitwise elsewhere, test_speculative; sampled here, against plain sampling, chi-square)."""
import math
from collections import Counter

import numpy as np
import pytest
from policy_views import view

from smartspec import LLM, SamplingParams
from smartspec.policy import GoodputPolicy
from smartspec.policy.proposer_choice import lookup_gains, select_proposers
from smartspec.spec_decode.suffix import FinishedOutputs, SuffixIndex, SuffixProposer, crop, path_probabilities
from smartspec.types.plan import DRAFT, LOOKUP
from smartspec.types.request import Request
from smartspec.types.step_record import StepRecord, VerifiedTree
from smartspec.types.tree import TokenTree


def occurrences(tokens):
    index = SuffixIndex()
    index.extend(0, tokens)
    return index.occurrences(tokens)


def test_the_longest_repeated_suffix_is_found_with_its_continuations():
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 2, 3]
    found = sorted((o.length, o.start) for o in occurrences(tokens))
    assert found == [(2, 4), (2, 9)]  # "2 3" twice, followed by 4 and 5 (the end itself has no continuation)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert [(o.length, o.start) for o in occurrences(tokens)] == [(5, 5)]  # the 4-gram anchor, extended to 5
    assert occurrences([1, 2, 3]) == []


def paths(tree):
    out = []
    for tok, p in zip(tree.tokens, tree.parents):
        out.append((out[p] if p >= 0 else []) + [tok])
    return out


def test_a_tree_merges_continuations_with_counts_as_confidences():
    index = SuffixIndex()
    for key, seq in enumerate([[5, 6, 7, 1], [5, 6, 7, 1], [5, 6, 8, 2]]):
        index.extend(key, seq)
    proposer = SuffixProposer(max_depth=3, branching=2, cache_tokens=0)
    proposer.finished.index = index
    req = Request("r", [9, 5], SamplingParams(max_tokens=16))
    tree = proposer.lookups([req], 8)[0]
    conf = {tuple(paths(tree)[i]): c for i, c in enumerate(tree.confidences)}
    discount = 1 / 2  # a 1-token match
    assert conf == pytest.approx({(6,): discount, (6, 7): discount * 2 / 3, (6, 8): discount / 3,
                                  (6, 7, 1): discount, (6, 8, 2): discount})
    chain = SuffixProposer(max_depth=3, branching=1, cache_tokens=0)
    chain.finished.index = index
    assert chain.lookups([req], 8)[0].tokens == [6, 7, 1]  # the most frequent path
    assert crop(tree, 2).tokens == [6, 7]
    probs = path_probabilities(tree)
    assert all(probs[i] <= probs[p] for i, p in enumerate(tree.parents) if p >= 0)


def test_finished_outputs_are_bounded_least_recently_used_first():
    cache = FinishedOutputs(max_tokens=10)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    cache.touch([0])  # the first was matched since: the second is now the oldest
    cache.add([9, 10, 11])
    assert cache.num_tokens == 7 and list(cache.order) == [0, 2]
    assert cache.index.occurrences([0, 5, 6]) == [] and cache.index.occurrences([1, 2])[0].start == 2
    assert all(key in cache.order for ends in cache.index.ends.values() for key, _ in ends)  # no stale entries


def test_a_repeated_output_is_drafted_from_the_finished_outputs(tiny_qwen):
    """The second run of a prompt finds the first run's output in the cache of finished outputs."""
    accepted = {}
    for cache_tokens in (0, 4096):
        llm = LLM(tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256,
                  speculative_config={"method": "suffix", "num_speculative_tokens": 8, "policy": "fixed",
                                      "suffix_cache_tokens": cache_tokens})
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        first = llm.generate(["qrst"], params)[0]
        m = llm.engine.speculation.metrics
        before = m.num_accepted_tokens
        assert llm.generate(["qrst"], params)[0].token_ids == first.token_ids
        accepted[cache_tokens] = m.num_accepted_tokens - before
    assert accepted[4096] >= 30 and accepted[4096] >= accepted[0] + 10, accepted


# ---- the choice between proposers ----------------------------------------------------------------------------------
def cost(v=0.020, per_token=0.001, d0=0.008, d1=0.0005):
    """A step: fixed part, each verified token, each draft forward, each draft token."""
    return lambda n, c, depth=0, sum_k=0: v + per_token * np.asarray(n) + d0 * np.asarray(depth) + d1 * np.asarray(sum_k)


def test_copying_goes_to_the_lookup_free_text_to_the_draft_heavy_load_to_none():
    k = 6
    copying = [0.97] * k  # its lookup tree: a long confident continuation
    writing = [0.0] * k  # nothing to look up
    lookups = lookup_gains([np.array(copying), np.array(writing)], k)
    draft = np.array([[0.5] * k, [0.9 ** j for j in range(1, k + 1)]])  # a draft model's acceptance per request
    plan = select_proposers(draft, lookups, [k, k], cost(d0=0.001, d1=0.0003), 2, 200)
    assert plan.methods == [LOOKUP, DRAFT] and plan.ks[0] == k and plan.ks[1] > 0
    # no draft model this step (its actor down): the lookups alone
    plan = select_proposers(None, lookups, [k, k], cost(d0=0.001, d1=0.0003), 2, 200)
    assert plan.methods[0] == LOOKUP and plan.ks == [k, 0]
    # a large batch where each verified token costs about what a token of the batch's own is worth (a CPU's
    # compute-bound step): nobody drafts, though the same drafts paid in the small batch
    b = 32
    likely = lookup_gains([np.array([0.7] * k), np.array(writing)] * (b // 2), k)
    plan = select_proposers(np.tile(draft, (b // 2, 1)), likely, [k] * b, cost(per_token=0.01, d0=0.001, d1=0.0003),
                            b, 200 * b)
    assert plan.ks == [0] * b
    plan = select_proposers(draft, likely[:2], [k, k], cost(d0=0.001, d1=0.0003), 2, 200)
    assert plan.ks[0] > 0 and plan.ks[1] > 0


def test_the_choice_is_exact_on_small_instances():
    """Brute force over every (proposer, k) per request, for random gains and costs."""
    rng = np.random.default_rng(1)
    for _ in range(40):
        b, k = 3, 3
        draft = np.sort(rng.random((b, k)), axis=1)[:, ::-1] * rng.random((b, 1))
        lookups = np.sort(rng.random((b, k)), axis=1)[:, ::-1] * (rng.random((b, 1)) > 0.4)
        f = cost(per_token=rng.uniform(0.0005, 0.01), d0=rng.uniform(0, 0.02), d1=rng.uniform(0, 0.003))
        plan = select_proposers(draft, lookups, [k] * b, f, b, 100)
        best = 0.0
        for choice in np.ndindex(*(2 * k + 1,) * b):
            tokens, depth, m, m_d = b, 0, 0, 0
            for i, c in enumerate(choice):
                if c == 0:
                    continue
                if c <= k:
                    tokens += lookups[i, :c].sum()
                    m += c
                else:
                    j = c - k
                    tokens += draft[i, :j].sum()
                    m, m_d, depth = m + j, m_d + j, max(depth, j)
            best = max(best, tokens / f(b + m, 100 + m, depth, m_d))
        assert plan.value >= 0.97 * best  # the per-depth proposer split is a heuristic: near the optimum


def test_the_depth_bound_never_changes_the_choice():
    """Deeper draft depths are skipped once no plan that deep could beat the best one found: on random instances
    (batch, k_max, prices, costs) the choice is the one a scan of every depth makes."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        b, k = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        draft = np.sort(rng.random((b, k)), axis=1)[:, ::-1] * rng.random((b, 1))
        lookups = np.sort(rng.random((b, k)), axis=1)[:, ::-1] * (rng.random((b, 1)) > 0.4)
        f = cost(per_token=rng.uniform(0.0005, 0.01), d0=rng.uniform(0, 0.02), d1=rng.uniform(0, 0.003))
        price = None if rng.random() < 0.7 else float(rng.uniform(5, 50))
        k_max = [int(c) for c in rng.integers(0, k + 1, size=b)]
        bounded = select_proposers(draft, lookups, k_max, f, b, 100, price)
        scanned = select_proposers(draft, lookups, k_max, f, b, 100, price, bound=False)
        assert (bounded.methods, bounded.ks, bounded.value) == (scanned.methods, scanned.ks, scanned.value)


def requests(n, context=40):
    return [Request(f"r{i}", list(range(context)), SamplingParams(max_tokens=64)) for i in range(n)]


def test_the_policy_learns_what_lookup_confidences_are_worth():
    """An over-confident lookup (confidence 0.9, accepted 20% of the time) loses its deeper drafts once
    calibrated."""
    policy = GoodputPolicy(key="suffix")
    policy.cost.v = [0.020, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.0]
    reqs = requests(1)
    tree = TokenTree.chain([1, 2, 3, 4], [0.9] * 4)
    ks = policy.plan(view(reqs, 4, lookups=[tree], use_draft=False)).ks
    assert ks == [4]  # taken at its word
    rng = np.random.default_rng(0)
    for step in range(400):
        path = [0] if rng.random() < 0.2 else []
        policy.observe(StepRecord(step, 1, [4], [4], [len(path)], ["r0"], 5, 0, 45, 0.0, 0.03, 0.03,
                                  methods=[LOOKUP], trees={"r0": VerifiedTree(tree, path)}, num_tokens=[41]))
    assert policy.calibration.probability(0.9) == pytest.approx(0.2, abs=0.05)
    assert policy.acceptance.evidence == 0  # a lookup's outcomes are not the draft model's
    ks = policy.plan(view(reqs, 4, lookups=[tree], use_draft=False)).ks
    assert ks[0] <= 1  # the first node still pays for its one verified token; the rest, 0.2^j, do not


def test_the_policy_sends_a_copying_request_to_the_lookup_and_another_to_the_draft():
    policy = GoodputPolicy(key="mixed", prior_alpha=0.8)
    policy.cost.v = [0.020, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.0]
    policy.cost.d = [0.004, 0.0005, 0.0]
    reqs = requests(2)
    policy.catchup.seen = {r.request_id: r.num_tokens - 1 for r in reqs}  # the draft has read both: no catch-up
    copying = TokenTree.chain([1, 2, 3, 4, 5], [0.99] * 5)
    plan = policy.plan(view(reqs, 5, lookups=[copying, TokenTree([], [], [])], use_draft=True))
    methods, ks = plan.methods, plan.ks
    assert methods == [LOOKUP, DRAFT] and ks[0] == 5 and ks[1] > 0


def test_a_learning_probe_pays_no_catch_up_a_decoding_step_would_not_pay():
    """While the draft's acceptance is unlearned, a request the lookups do not serve probes the draft only where its
    catch-up costs a small share of the decoding steps it is spread over: beside a prefill chunk as without one (the
    long prefill step does not make a whole prompt's catch-up cheap)."""
    empty = TokenTree([], [], [])
    for seen, probes in ((0, False), (37, True)):  # a fresh request catches up 39 tokens; a known one 2
        for prefill in (0, 200):
            policy = GoodputPolicy(key="mixed")
            policy.cost.v = [0.040, 0.005, 0.005, 0.005, 0.005, 0.005, 0.005, 0.0]
            policy.cost.d = [0.030, 0.002, 0.002]  # a catch-up token costs 2 ms: 78 ms for the fresh request
            reqs = requests(1)
            policy.catchup.seen = {reqs[0].request_id: seen}
            prefilling = [Request("p", list(range(prefill)), SamplingParams(max_tokens=8))] if prefill else []
            plan = policy.plan(view(reqs, 4, lookups=[empty], use_draft=True, base_tokens=prefill,
                                    base_context=prefill, prefilling=prefilling))
            methods, ks = plan.methods, plan.ks
            assert (methods, ks) == (([DRAFT], [1]) if probes else ([LOOKUP], [0])), (seen, prefill)


# ---- sampled output follows the target -----------------------------------------------------------------------------
def sample_prefixes(path, spec, n=1500):
    llm = LLM(path, num_kv_blocks=256, block_size=4, max_model_len=128, max_num_seqs=32, speculative_config=spec)
    prompt = "abab abab abab ab"
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s,
                                                      ignore_eos=True) for s in range(n)])
    return Counter(tuple(o.token_ids) for o in outs), llm.engine.speculation.metrics


@pytest.fixture(scope="module")
def plain_sample(tiny_qwen):
    return sample_prefixes(tiny_qwen, None)[0]


@pytest.mark.parametrize("spec", [
    {"method": "suffix", "num_speculative_tokens": 3, "policy": "fixed"},
    {"method": "suffix", "tree": {"max_nodes": 6, "max_depth": 2, "branching": 3}, "policy": "fixed"},
    {"method": ["draft_model", "suffix"], "num_speculative_tokens": 2, "policy": "fixed"},
], ids=["chain", "tree", "mixed"])
def test_sampled_speculation_follows_the_target(spec, tiny_qwen, tiny_qwen_draft, plain_sample):
    """Two-sample chi-square on the first three tokens (top_k = 3: 27 outcomes) against plain sampling."""
    if "draft_model" in spec["method"]:
        spec = {**spec, "model": tiny_qwen_draft}
    spec_sample, m = sample_prefixes(tiny_qwen, spec)
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # drafts were both accepted and rejected
    keys = [k for k in set(plain_sample) | set(spec_sample) if plain_sample[k] + spec_sample[k] >= 10]
    a = np.array([plain_sample[k] for k in keys], dtype=float)
    b = np.array([spec_sample[k] for k in keys], dtype=float)
    stat = float((((a - b) ** 2) / (a + b)).sum())  # equal sample sizes
    dof = len(keys) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))  # Wilson-Hilferty
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-4, (stat, dof)


@pytest.mark.parametrize("bad,message", [
    ({"method": ["draft_model", "ngram"]}, "can be mixed as"),
    ({"method": ["draft_model", "suffix"], "tree": {"max_nodes": 4}}, "drafts chains"),
    ({"method": ["draft_model", "suffix"], "model": None}, "needs speculation.model"),
    ({"method": "suffix", "suffix_cache_tokens": -1}, "suffix_cache_tokens"),
])
def test_bad_suffix_configs_are_rejected(bad, message):
    from smartspec.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_a_mixed_config_reads_as_written():
    from smartspec.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": ["suffix", "draft_model"]})
    assert spec.methods == ("draft_model", "suffix") and spec.single("suffix").method == "suffix"
    assert spec.as_dict()["method"] == ["draft_model", "suffix"]
    assert SpeculativeConfig.parse({"method": ["suffix"]}).method == "suffix"


def test_the_warm_up_profile_measures_the_draft_beside_the_lookups(tiny_qwen, tiny_qwen_draft):
    """Lookups cost no forward; the profile drafts with the draft model, so its cost is known before it is chosen."""
    # caches that hold every profile prompt: a catch-up must not be measured only because a prefix was evicted
    llm = LLM(tiny_qwen, num_kv_blocks=2048, block_size=4, max_model_len=256,
              speculative_config={"method": ["draft_model", "suffix"], "model": tiny_qwen_draft,
                                  "num_speculative_tokens": 3})
    policy = llm.engine.speculation.policy
    assert policy.cost.ready and policy.cost.d[0] + policy.cost.d[1] > 0
    assert llm.engine.speculation.proposer.lookup.finished.num_tokens == 0  # profile outputs are not kept
    # a profile run again (the draft's prefix cache now holds the first one's prompts) still measures catch-ups:
    # each drafting shape's requests read their prompts afresh, so the fit learns what a catch-up costs
    records = llm.engine.profile_steps()
    caught_up = {max(r.ks) for r in records if r.draft_catchup_tokens}
    assert caught_up == {1, 2, 3}, [(r.batch_size, r.ks, r.draft_catchup_tokens) for r in records]
