"""A seed repeats itself: a seeded sampled request's tokens are a function of the target's distribution and noise
keyed by (seed, position) alone, so they do not depend on what the proposers offered (answers kept from earlier
requests, the chosen k, a draft model's own draws), on the batch, or on the request before. They equal seeded
decoding without speculation, and they still follow the target distribution (chi-square)."""
import pytest
import torch
from chi_square import CHI2_CRIT, chi2
from engines import MixedPolicy, PricedGoodputPolicy, make

from smartspec import SamplingParams
from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import target_probs
from smartspec.spec_decode.accept import accept_drafts
from smartspec.spec_decode.proposer import Draft
from smartspec.types.request import Request

PROMPTS = ["abcabcabcabc abc", "def f(x): return x\ndef g(x): return x\ndef", "xyz " * 8, "hello world"]
SEEDED = [SamplingParams(max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=1.0, top_k=8, seed=99, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.9, min_p=0.05, presence_penalty=0.4, seed=3, ignore_eos=True)]


def configs(target: str, draft: str) -> dict[str, dict]:
    return {
        "ngram, fixed k": {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"},
        "suffix, answer memory on": {"method": "suffix", "num_speculative_tokens": 4, "policy": "fixed"},
        "suffix, answer memory off": {"method": "suffix", "num_speculative_tokens": 4, "policy": "fixed",
                                      "suffix_cache_tokens": 0},
        "draft model, goodput k": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                                   "policy": PricedGoodputPolicy()},
        "draft model, k per request and step": {"method": "draft_model", "model": draft,
                                                "num_speculative_tokens": 4, "policy": MixedPolicy()},
        "self draft, tree": {"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                             "policy": "fixed", "tree": {"max_nodes": 8, "max_depth": 3, "branching": 2}},
    }


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    """Seeded decoding without speculation, each request alone."""
    llm = make(tiny_qwen)
    return [llm.generate(p, s)[0].token_ids for p, s in zip(PROMPTS, SEEDED)]


def test_without_speculation_alone_and_batched_agree(tiny_qwen, plain):
    assert [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, SEEDED)] == plain


@pytest.mark.parametrize("name", list(configs("", "")))
def test_seeded_requests_equal_plain_seeded_decoding_under_every_proposer(name, tiny_qwen, tiny_qwen_draft, plain):
    # warm-up profile off: the priced goodput policy keeps its costs, and what it drafts is not up to the clock
    llm = make(tiny_qwen, configs(tiny_qwen, tiny_qwen_draft)[name], warmup_profile=False)
    batched = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
    again = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]  # answer memory now holds the first answers
    alone = [llm.generate(p, s)[0].token_ids for p, s in zip(PROMPTS, SEEDED)]
    capped = [o.token_ids for o in llm.generate(PROMPTS, [SamplingParams(**{**vars(s), "k_cap": 0})
                                                          for s in SEEDED])]
    assert batched == plain and again == plain and alone == plain and capped == plain
    assert llm.engine.speculation.metrics.num_draft_tokens > 0  # it did speculate


def test_the_same_request_twice_in_a_row_repeats_itself_with_answer_memory(tiny_qwen):
    """The reported case: the second run's suffix proposer offers the first answer; the answer is the same."""
    llm = make(tiny_qwen, {"method": "suffix", "num_speculative_tokens": 4, "policy": PricedGoodputPolicy()},
               warmup_profile=False)
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=1234)
    first, second = (llm.generate("Invent a name for a cat.", p)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    assert second.speculation.num_accepted_tokens > 0  # the memory was used, and changed nothing


def seeded_step(seed: int, p_rows: torch.Tensor, draft: list[int]):
    """One seeded request verifying a chain draft against fixed target rows (each row's distribution is p_rows[j]
    whatever the tokens before: what makes the marginals checkable)."""
    params = SamplingParams(temperature=1.0, seed=seed)
    req = Request("r", [1, 2, 3], params)
    item = ForwardItem(req, [0] * (1 + len(draft)), 3, 1 + len(draft))
    return accept_drafts([item], p_rows.log(), {"r": Draft(draft, None)}).tokens["r"]


def test_seeded_speculation_follows_the_target_distribution():
    """Over seeds, token j of a step follows p at position j given the drafts before it were accepted; the draft
    comes from another distribution q and is accepted where it equals the seeded token."""
    g = torch.Generator().manual_seed(0)
    V, K = 8, 3
    p = target_probs(torch.randn(K + 1, V, generator=g) * 1.5, SamplingParams(temperature=1.0))
    # a draft close to the target, so that deep positions are reached often enough to be counted
    q = 0.5 * p[:K] + 0.5 * torch.nn.functional.one_hot(p[:K].argmax(-1), V)
    by_index = [[] for _ in range(K + 1)]
    for seed in range(6000):
        draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(K)]
        for j, tok in enumerate(seeded_step(seed, p, draft)):
            by_index[j].append(tok)
    stats = [chi2(s, p[j]) for j, s in enumerate(by_index) if len(s) > 500]
    assert len(stats) >= 3 and max(stats) < CHI2_CRIT, stats


def test_seeded_rows_drawn_in_several_passes_are_each_requests_own(monkeypatch):
    """seeded_draws draws at most SEEDED_ROWS_AT_ONCE rows a pass (whole requests' blocks; a block longer than
    that alone), of blocks or of single rows: its tokens, pass boundaries wherever they fall, are each request's
    seeded_tokens alone."""
    import smartspec.runtime.sampler as sampler

    g = torch.Generator().manual_seed(0)
    blocks = [torch.softmax(torch.randn(n, 50, generator=g), -1) for n in (2, 1, 4, 2, 1)]
    starts = [10, 3, 40, 7, 0]
    seeds = [5, 6, 7, 8, 9]
    alone = torch.cat([sampler.seeded_tokens(b, s, list(range(at, at + len(b))))
                       for b, s, at in zip(blocks, seeds, starts)])
    keys = [(s, at + j) for b, s, at in zip(blocks, seeds, starts) for j in range(len(b))]
    rows = [row for block in blocks for row in block]  # the same rows one by one, as the draft model gives them
    for at_once in (64, 3, 1):
        monkeypatch.setattr(sampler, "SEEDED_ROWS_AT_ONCE", at_once)
        assert torch.equal(sampler.seeded_draws(blocks, keys), alone), at_once
        assert torch.equal(sampler.seeded_draws(rows, keys), alone), at_once
