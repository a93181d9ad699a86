"""The draft model's sampled rows made together at each depth (spec_decode/draft_sampling.py): the same draft
distributions, bitwise, as each request's own target_probs, so the same drafts and the same outputs, for sampled
requests with every control, seeded and not, beside greedy ones."""
import torch
from engines import PROMPTS, make

import smartspec.spec_decode.draft_sampling as draft_sampling
from smartspec import SamplingParams
from smartspec.spec_decode.draft_model import DraftModelProposer

REAL_PROPOSE = DraftModelProposer.propose


def requests() -> list[SamplingParams]:
    kinds = [dict(temperature=0.9, top_k=8), dict(temperature=0.7, top_p=0.8), dict(temperature=1.1, min_p=0.05),
             dict(temperature=0.8, top_k=5, top_p=0.9, seed=3), dict(temperature=0.6, seed=4), dict()]
    return [SamplingParams(max_tokens=12, ignore_eos=True, **kind) for kind in kinds]


def run(tiny_qwen, tiny_qwen_draft, monkeypatch) -> tuple[list[list[int]], list]:
    """The outputs, and every proposal's drafts and draft distributions."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed", "model": tiny_qwen_draft}
    llm = make(tiny_qwen, spec)
    proposals, real = [], REAL_PROPOSE

    def kept(self, *args, **kwargs):
        proposal = real(self, *args, **kwargs)
        proposals.append((proposal.tokens, proposal.probs))
        return proposal
    monkeypatch.setattr(DraftModelProposer, "propose", kept)
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(6)], requests())
    return [o.token_ids for o in outs], proposals


def test_draft_distributions_made_together_give_the_same_drafts_and_outputs(tiny_qwen, tiny_qwen_draft,
                                                                               monkeypatch):
    made = []
    real = draft_sampling.DraftSampling.probs

    def counted(self, *args):
        got = real(self, *args)
        made.append(len(got))
        return got
    monkeypatch.setattr(draft_sampling.DraftSampling, "probs", counted)
    together, proposed = run(tiny_qwen, tiny_qwen_draft, monkeypatch)
    assert proposed and max(made) >= 4  # the five sampled requests' rows were made together
    monkeypatch.setattr(draft_sampling.DraftSampling, "probs", lambda self, *args: {})
    alone, proposed_alone = run(tiny_qwen, tiny_qwen_draft, monkeypatch)
    assert together == alone and len(proposed) == len(proposed_alone)
    for (tokens, probs), (tokens_alone, probs_alone) in zip(proposed, proposed_alone):
        assert tokens == tokens_alone
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(probs, probs_alone))


def test_unseeded_draft_rows_are_drawn_in_one_race_as_a_row_at_a_time(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """The unseeded sampled rows of a depth (sharing the engine's generator) drawn in one race give the drafts and
    outputs that a draw a row gives, in order (torch.multinomial's, the same stream)."""
    import smartspec.spec_decode.draft_model as draft_model

    races, real = [], draft_model.draw_rows

    def counted(probs, generators):
        races.append(len(probs))
        return real(probs, generators)
    monkeypatch.setattr(draft_model, "draw_rows", counted)
    together, proposed = run(tiny_qwen, tiny_qwen_draft, monkeypatch)
    assert proposed and max(races) == 3  # the three unseeded sampled requests' rows of a depth in one call

    def a_row_at_a_time(probs, generators):
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    monkeypatch.setattr(draft_model, "draw_rows", a_row_at_a_time)
    alone, proposed_alone = run(tiny_qwen, tiny_qwen_draft, monkeypatch)
    assert together == alone
    assert [tokens for tokens, _ in proposed] == [tokens for tokens, _ in proposed_alone]
