"""The draft-model proposer on its own: k lockstep draft forwards over the requests that want tokens, a catch-up on
what the draft has not seen, its cache kept to what the target committed, and its draws reported with their
distributions (what sampled acceptance needs)."""
import pytest
import torch

from smartspec import LLM
from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.spec_decode.draft_model import DraftModelProposer
from smartspec.spec_decode.factory import DraftRuntime, make_draft_proposer
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 42, 8, 61]


def draft_of(target_llm, draft_path, num_blocks=32):
    engine = target_llm.engine
    spec = SpeculativeConfig(method="draft_model", model=draft_path)
    return make_draft_proposer(spec, DraftRuntime(engine.tokenizer, engine.vocab_size, num_blocks, 4, True))


@pytest.fixture(scope="module")
def target(tiny_qwen):
    return LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_model_len=256)


def test_a_draft_that_is_the_target_drafts_the_targets_own_tokens(target, tiny_qwen):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = target.generate([PROMPT], params)[0].token_ids
    draft = draft_of(target, tiny_qwen)
    assert isinstance(draft, DraftModelProposer) and draft.draft_available
    req = Request("r", list(PROMPT), params)
    proposal = draft.propose([req], [4])
    assert proposal.tokens == [expected[:4]] and proposal.probs == [None]  # greedy: deterministic drafts
    assert proposal.catchup_tokens == len(PROMPT) - 1  # it read the prompt before its first draft


def test_the_draft_keeps_what_the_target_committed_and_catches_up_on_the_rest(target, tiny_qwen):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = target.generate([PROMPT], params)[0].token_ids
    draft = draft_of(target, tiny_qwen)
    req = Request("r", list(PROMPT), params)
    draft.propose([req], [3])
    # the target accepted two drafts and made its own third token, then ran two steps at k = 0
    req.token_ids += expected[:5]
    draft.sync(req)
    assert draft.state["r"].num_computed_tokens == len(PROMPT) + 2  # the fed tokens it agrees with stay cached
    proposal = draft.propose([req], [2])
    assert proposal.tokens == [expected[5:7]]
    assert proposal.catchup_tokens == 2  # the target's own token and the two made at k = 0, less the one fed anyway
    draft.release("r")
    assert draft.blocks.num_free == draft.blocks.num_blocks and not draft.state


def test_the_drafts_state_follows_the_target_step_after_step(target, tiny_qwen):
    """Many steps of random outcomes (k from 0 to 4, a random number of drafts accepted, the target's own token
    differing from the next draft), the target's token list sometimes replaced by an equal copy (as the draft
    actor's mirror is), synced after some steps and otherwise at the next proposal: after each sync the draft's tokens are the target's, and the KV it keeps is exactly its fed
    tokens up to the first the target did not take. Fails if the sync trusted more than it compared."""
    import random

    rng = random.Random(3)
    draft = draft_of(target, tiny_qwen, num_blocks=128)
    req = Request("r", list(PROMPT), SamplingParams(max_tokens=400, ignore_eos=True))
    for step in range(60):
        k = rng.choice([0, 1, 2, 4])
        fed = len(req.token_ids)
        drafts = draft.propose([req], [k]).tokens[0] if k else []
        if drafts:
            fed += len(drafts) - 1  # every draft but the last was fed
        taken = rng.randrange(len(drafts) + 1)
        own = rng.choice([t for t in range(50, 60) if taken == len(drafts) or t != drafts[taken]])
        agreed = len(req.token_ids) + taken  # the target's tokens the draft's state shares
        req.token_ids += drafts[:taken] + [own]
        if rng.random() < 0.3:
            req.token_ids = list(req.token_ids)
        if rng.random() < 0.5:  # else the next proposal syncs it, several tokens on (the actor's mirror, at k = 0)
            continue
        draft.sync(req)
        if "r" in draft.state:
            ds = draft.state["r"]
            assert ds.token_ids == req.token_ids, step
            if drafts:
                assert ds.num_computed_tokens == min(fed, agreed), step
    assert "r" in draft.state and len(req.token_ids) > 80


def test_a_long_context_is_caught_up_in_pieces_and_drafts_as_if_read_at_once(target, tiny_qwen, monkeypatch):
    """Pieces of 3 tokens (the real ones are 256): two requests of 7 and 11 tokens read in pieces, then their last
    token, and drafted the target's own tokens (the draft is the target); the catch-up counted is the whole."""
    import smartspec.spec_decode.draft_model as draft_model
    monkeypatch.setattr(draft_model, "CATCHUP_CHUNK", 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [list(PROMPT), [9, 4, 77, 31, 2, 60, 13, 5, 88, 21, 40]]
    expected = [out.token_ids for out in target.generate(prompts, params)]
    draft = draft_of(target, tiny_qwen)
    forwards = []
    real_forward = draft.runner.forward
    monkeypatch.setattr(draft.runner, "forward", lambda items: forwards.append([len(i.tokens) for i in items])
                        or real_forward(items))
    proposal = draft.propose([Request("a", prompts[0], params), Request("b", prompts[1], params)], [4, 4])
    assert proposal.tokens == [expected[0][:4], expected[1][:4]]
    assert proposal.catchup_tokens == 7 - 1 + 11 - 1
    assert forwards[:5] == [[3], [3], [3], [3], [3]] and forwards[5] == [1, 2]  # then one forward per depth


def test_requests_at_k_zero_cost_the_draft_nothing(target, tiny_qwen):
    draft = draft_of(target, tiny_qwen)
    reqs = [Request(f"r{i}", list(PROMPT), SamplingParams(max_tokens=8)) for i in range(2)]
    proposal = draft.propose(reqs, [0, 2])
    assert proposal.tokens[0] == [] and len(proposal.tokens[1]) == 2 and "r0" not in draft.state


def test_a_full_draft_cache_drafts_nothing_and_loses_nothing(target, tiny_qwen):
    draft = draft_of(target, tiny_qwen, num_blocks=2)  # 8 slots: not enough for a 7-token prompt and 4 drafts
    req = Request("r", list(PROMPT), SamplingParams(max_tokens=8))
    assert draft.propose([req], [4]).tokens == [[]]
    assert draft.propose([req], [1]).tokens != [[]]  # a shorter draft still fits


def test_sampled_drafts_come_with_the_distributions_they_were_drawn_from(target, tiny_qwen_draft):
    draft = draft_of(target, tiny_qwen_draft)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3)
    req = Request("r", list(PROMPT), params, torch.Generator().manual_seed(3))
    proposal = draft.propose([req], [3])
    (q,) = proposal.probs
    assert q.shape == (3, target.engine.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert all(q[j, tok] > 0 for j, tok in enumerate(proposal.tokens[0]))  # each token is one it could draw
    assert all(int((row > 0).sum()) <= 20 for row in q)  # top_k applies to the draft as to the target


def test_a_batch_drafts_what_each_of_its_requests_drafts_alone(target, tiny_qwen_draft):
    """Greedy rows' tokens taken in one pass, seeded rows' drawn together, the rest each by its own generator, then
    put back in the batch's order: each request's drafts and distributions are the ones it gets drafted alone (a
    row misplaced would still be lossless, only accepted less: hence this test)."""
    kinds = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, top_k=20),
             SamplingParams(max_tokens=8, temperature=0.7, seed=11),
             SamplingParams(max_tokens=8, repetition_penalty=1.3),
             SamplingParams(max_tokens=8, temperature=1.1, seed=5), SamplingParams(max_tokens=8)]

    def requests():
        return [Request(f"r{i}", [p + i for p in PROMPT], params, torch.Generator().manual_seed(i))
                for i, params in enumerate(kinds)]

    together = draft_of(target, tiny_qwen_draft).propose(requests(), [3, 2, 3, 3, 1, 2])
    for i, (req, k) in enumerate(zip(requests(), [3, 2, 3, 3, 1, 2])):
        alone = draft_of(target, tiny_qwen_draft).propose([req], [k])
        assert together.tokens[i] == alone.tokens[0], f"request {i}"
        if alone.probs[0] is None:
            assert together.probs[i] is None
        else:
            assert torch.equal(together.probs[i], alone.probs[0]), f"request {i}"


def test_a_draft_of_another_vocabulary_is_refused(target, tiny_llama_tied):
    with pytest.raises(ValueError, match="same vocabulary"):
        draft_of(target, tiny_llama_tied)


def test_a_prompt_the_drafts_prefix_cache_holds_is_reported_as_not_to_be_read(target, tiny_qwen):
    """held_tokens: for a request the draft never read, the full blocks of its context the draft's prefix cache
    holds (a prompt another request drafted for), 0 for one it never saw; for one it holds state for, its context
    but the last token, not the drafts it fed past it. What it reports is what the first draft then leaves out of
    its catch-up."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = target.engine
    spec = SpeculativeConfig(method="draft_model", model=tiny_qwen)
    draft = make_draft_proposer(spec, DraftRuntime(engine.tokenizer, engine.vocab_size, 32, 4, True,
                                                   enable_prefix_caching=True))
    first = Request("first", PROMPT * 2, params)
    draft.propose([first], [3])
    assert draft.state["first"].num_computed_tokens > first.num_tokens  # it fed two drafts
    assert draft.held_tokens([first]) == [first.num_tokens - 1]
    draft.release("first")
    again, other = Request("again", PROMPT * 2 + [11], params), Request("other", [1, 2] + PROMPT * 2, params)
    assert draft.held_tokens([again, other]) == [12, 0]  # three full blocks of 4 of the 14 read before
    assert draft.propose([again], [1]).catchup_tokens == again.num_tokens - 1 - 12
    assert draft.held_tokens([again]) == [again.num_tokens - 1]
