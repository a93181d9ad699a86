"""Logprobs are the target's log-softmax of the very logits that predicted each token: the same bits with and without
speculation (chains, trees, draft model, prompt lookup), with chunked prefill, and under sampling, where each value
is checked against the engine's own scoring of the finished sequence."""
import pytest
import torch
from lossless import token_logprob

from smartspec import LLM, SamplingParams
from smartspec.types.logprobs import rows_of_new_tokens

PROMPTS = ["abcabcabcabc abc", "def f(x): return x\ndef g(x): return x\ndef", "xyz " * 8, "hello world"]
SPECS = {
    "ngram chain": {"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"},
    "ngram tree": {"method": "ngram", "tree": {"max_nodes": 8, "max_depth": 3, "branching": 2}, "policy": "fixed"},
    "draft chain": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"},
    "draft tree": {"method": "draft_model", "tree": {"max_nodes": 6, "max_depth": 3}, "policy": "fixed"},
}


def make(path, spec=None, **kw):
    return LLM(path, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec, **kw)


def params(seed=None, **kw):
    temperature = 0.0 if seed is None else 0.8
    return [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature, seed=seed, logprobs=3, **kw)
            for n in (30, 18, 25, 9)]


def with_draft(spec, draft):
    return {**spec, "model": draft} if spec["method"] == "draft_model" else spec


def assert_scored(llm, out):
    """Every logprob (prompt and output) is the engine's own forward over the finished sequence, bit for bit."""
    ids = out.prompt_token_ids + out.token_ids
    scored = llm.engine.runner.score(ids)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos] if pos < len(out.prompt_token_ids) else \
            out.logprobs[pos - len(out.prompt_token_ids)]
        if got is None:
            continue
        want = token_logprob(scored[pos - 1], ids[pos], len(got.top))
        assert got == want, (pos, got, want)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return make(tiny_qwen).generate(PROMPTS, params(prompt_logprobs=2))


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_logprobs_equal_with_and_without_speculation(tiny_qwen, tiny_qwen_draft, plain, name):
    llm = make(tiny_qwen, with_draft(SPECS[name], tiny_qwen_draft))
    outs = llm.generate(PROMPTS, params(prompt_logprobs=2))
    assert llm.engine.speculation.metrics.num_accepted_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.logprobs for o in outs] == [o.logprobs for o in plain]
    assert [o.prompt_logprobs for o in outs] == [o.prompt_logprobs for o in plain]


@pytest.mark.parametrize("name", ["ngram chain", "draft chain", "draft tree"])
def test_sampled_logprobs_are_the_targets_under_speculation(tiny_qwen, name):
    """The target drafting for itself: under sampling every draft is accepted, so each step's logprobs come from
    rows deep in its chain or tree."""
    llm = make(tiny_qwen, with_draft(SPECS[name], tiny_qwen))
    outs = llm.generate(PROMPTS, params(seed=11, prompt_logprobs=1))
    m = llm.engine.speculation.metrics
    assert m.num_drafts > 0 and (name.startswith("ngram") or m.num_accepted_tokens > 20)
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        assert_scored(llm, out)


def test_logprob_fields_and_chunked_prefill(tiny_qwen, plain):
    chunked = make(tiny_qwen, max_num_batched_tokens=5).generate(PROMPTS, params(prompt_logprobs=2))
    assert [o.prompt_logprobs for o in chunked] == [o.prompt_logprobs for o in plain]
    assert [o.logprobs for o in chunked] == [o.logprobs for o in plain]
    out = plain[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [p.token_id for p in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
    assert all(len(p.top) == 2 for p in out.prompt_logprobs[1:])
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.rank == 1 and lp.top[0] == (tok, lp.logprob)  # greedy: the top token
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0
    assert_scored(make(tiny_qwen), out)
    # not asked: not computed
    bare = make(tiny_qwen).generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0]
    assert bare.logprobs is None and bare.prompt_logprobs is None


def test_logprobs_survive_preemption(tiny_qwen, plain):
    """A cache too small for all four requests: some are preempted and recomputed, values unchanged."""
    llm = LLM(tiny_qwen, num_kv_blocks=26, block_size=4, max_model_len=64)
    outs = llm.generate(PROMPTS, params(prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.logprobs for o in outs] == [o.logprobs for o in plain]
    assert [o.prompt_logprobs for o in outs] == [o.prompt_logprobs for o in plain]


def test_rows_of_new_tokens():
    assert rows_of_new_tokens(3, None) == [0, 1, 2]
    assert rows_of_new_tokens(3, [4, 6]) == [0, 5, 7]  # root, then the accepted nodes' rows
    assert rows_of_new_tokens(1, []) == [0]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_logprob_counts_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=bad)


def test_token_logprob_is_log_softmax():
    row = torch.tensor([1.0, 3.0, 2.0, -1.0])
    lp = token_logprob(row, 2, 2)
    want = torch.log_softmax(row, -1)
    assert lp.logprob == float(want[2]) and lp.rank == 2 and lp.top == ((1, float(want[1])), (2, float(want[2])))


def test_a_steps_logprobs_come_to_the_host_in_one_read(monkeypatch):
    """Requests with different top sizes (none, 2, 5) over rows in any order: one read for all, each value the one
    its row gives alone (token_logprob); a request whose token is out of range fails alone."""
    from smartspec.engine.step_logprobs import LogprobRows, logprobs_of, read_logprobs
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 3
    parts = [LogprobRows("a", [0, 1, 2], [4, 9, 4], 0), LogprobRows("b", [5, 3], [1, 49], 2),
             LogprobRows("c", [6], [17], 5), LogprobRows("d", [4], [8], 2)]
    reads, tolist = [], torch.Tensor.tolist

    def counted(t):
        reads.append(t.shape)
        return tolist(t)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    read = read_logprobs(logits, parts)
    monkeypatch.undo()
    assert len(reads) == 1
    for part in parts:
        want = [token_logprob(logits[r], t, part.top) for r, t in zip(part.rows, part.tokens)]
        assert logprobs_of(read, part.request_id) == want
    bad = read_logprobs(logits, parts[:2] + [LogprobRows("e", [1], [50], 1)])
    assert isinstance(bad["e"], IndexError) and bad["b"] == read["b"] and bad["a"] == read["a"]
    with pytest.raises(IndexError):
        logprobs_of(bad, "e")
