"""Prefix caching: full KV blocks shared by the tokens they hold. Outputs are the same bits with and without it
(greedy and seeded sampling, with speculation from a draft model whose cache shares prefixes too), nothing
leaks, and cached blocks give way under pressure."""
import pytest

from smartspec import LLM, SamplingParams
from smartspec.runtime.block_manager import BlockManager
from smartspec.types.request import Request

SYSTEM = "You are a careful assistant. Answer in one short line. " * 3
PROMPTS = [SYSTEM + q for q in ("abcabc abc", "def f(x): return", "xyz xyz", "hello world")]


def req(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def computed(bm, r):
    bm.allocate(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    return r


def test_full_blocks_are_shared_by_their_tokens_and_evicted_oldest_first():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a = computed(bm, req(range(10), "a"))
    bm.free(a)  # registers blocks [0-3] and [4-7]; the partial third is not
    assert bm.num_free == 6
    b = req(list(range(8)) + [99, 98, 97], "b")
    assert bm.match_prefix(b, b.num_tokens - 1) == 8 and b.num_computed_tokens == 8
    assert bm.num_free == 4 and (bm.num_prefix_queries, bm.num_prefix_hits) == (8, 8)
    c = req(range(12), "c")
    assert bm.match_prefix(c, c.num_tokens - 1) == 8  # shared by b and c
    assert c.block_table == b.block_table and bm.num_free == 4
    bm.free(b)
    assert bm.num_free == 4  # c still holds them
    bm.free(c)
    assert bm.num_free == 6
    # a prompt that is whole blocks keeps its last token to compute (it gives the logits)
    d = req(range(8), "d")
    assert bm.match_prefix(d, d.num_tokens - 1) == 4
    bm.free(d)
    # handing out every free block evicts the cached ones: nothing is found after
    e = req(range(100, 124), "e")
    bm.allocate(e, 24)
    bm.free(e)
    f = req(range(10), "f")
    assert bm.match_prefix(f, 9) == 0 and f.block_table == []


def test_a_different_earlier_token_misses():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.free(computed(bm, req(range(12), "a")))
    b = req([7] + list(range(1, 12)), "b")  # blocks 1 and 2 hold the same tokens, after a different block 0
    assert bm.match_prefix(b, 11) == 0
    off = BlockManager(8, 4)
    off.free(computed(off, req(range(12), "a")))
    assert off.match_prefix(req(range(12)), 11) == 0


def make(path, caching, spec=None, **kw):
    return LLM(path, num_kv_blocks=kw.pop("num_kv_blocks", 128), block_size=4, max_model_len=256,
               speculative_config=spec, enable_prefix_caching=caching, **kw)


def run_twice(llm, params):
    """The prompts one after another, then all at once: the later ones find the shared prefix cached."""
    first = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    again = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return first + again


@pytest.mark.parametrize("seed", [None, 7])
def test_outputs_equal_with_and_without_caching(tiny_qwen, seed):
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0 if seed is None else 0.9, seed=seed)
    cached = make(tiny_qwen, True)
    assert run_twice(cached, params) == run_twice(make(tiny_qwen, False), params)
    blocks = cached.engine.blocks
    assert blocks.num_prefix_hits >= 0.5 * blocks.num_prefix_queries > 0  # all but the first prompt hit
    assert blocks.num_free == blocks.num_blocks


def test_draft_model_and_its_cache_share_prefixes(tiny_qwen, tiny_qwen_draft):
    spec = {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 3, "policy": "fixed"}
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cached = make(tiny_qwen, True, spec)
    assert run_twice(cached, params) == run_twice(make(tiny_qwen, False), params)
    draft = cached.engine.speculation.proposer
    assert draft.blocks.num_prefix_hits > 0 and cached.engine.speculation.metrics.num_accepted_tokens > 0
    assert cached.engine.blocks.num_free == cached.engine.blocks.num_blocks
    assert draft.blocks.num_free == draft.blocks.num_blocks and not draft.state


def test_eviction_preemption_and_aborts_under_a_small_cache(tiny_qwen):
    """A cache that cannot keep every prefix: cached blocks are evicted as needed, requests preempted and aborted,
    and what finishes is what an uncached engine makes."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    small = make(tiny_qwen, True, num_kv_blocks=80)
    eng = small.engine
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    eng.step()
    eng.abort_request(ids[1])
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert eng.scheduler.num_preemptions > 0
    want = make(tiny_qwen, False).generate(prompts, params)
    assert [done[i] for i in ids if i != ids[1]] == [o.token_ids for i, o in zip(ids, want) if i != ids[1]]
    assert eng.blocks.num_free == eng.blocks.num_blocks
    # and again, now from what the small cache kept
    assert [o.token_ids for o in small.generate(prompts, params)] == [o.token_ids for o in want]
    assert eng.blocks.num_prefix_hits > 0


def test_prompt_logprobs_are_computed_not_reused(tiny_qwen):
    llm = make(tiny_qwen, True)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    hits = llm.engine.blocks.num_prefix_hits
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, prompt_logprobs=0))[0]
    assert llm.engine.blocks.num_prefix_hits == hits and all(p is not None for p in out.prompt_logprobs[1:])
