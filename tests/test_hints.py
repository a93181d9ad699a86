"""Drafts requests carry: the tokens a grammar forces (jump-forward) and a predicted output's continuation. They are
verified like any draft (greedy output unchanged, with every configured proposer beside them), they are drafted
where they apply, and a prediction's accepted and rejected tokens are counted per request."""
import re

import pytest
from engines import PROMPTS, make, run_staggered

from smartspec import SamplingParams
from smartspec.spec_decode.hints import GRAMMAR, PREDICTION, RequestHints
from smartspec.types.request import Request
from smartspec.types.sampling_params import StructuredOutput

LONG_KEYS = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 5},
    "order_identifier_number": {"type": "integer", "minimum": 0, "maximum": 99},
    "is_express_delivery": {"type": "boolean"}},
    "required": ["customer_full_name", "order_identifier_number", "is_express_delivery"],
    "additionalProperties": False}
METHODS = ["ngram", "suffix", "draft_model", ["draft_model", "suffix"]]


def spec_of(method, draft, policy="fixed"):
    spec = {"method": method, "num_speculative_tokens": 4, "policy": policy}
    if "draft_model" in method:
        spec["model"] = draft
    return spec


@pytest.fixture(scope="module")
def plain_json(tiny_qwen):
    params = SamplingParams(max_tokens=120, structured=StructuredOutput(json=LONG_KEYS))
    return [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, params)]


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_forced_tokens_are_drafted_and_output_is_unchanged(method, tiny_qwen, tiny_qwen_draft, plain_json,
                                                           monkeypatch):
    import smartspec.engine.llm_engine as engine_module

    llm = make(tiny_qwen, spec_of(method, tiny_qwen_draft))
    sources, propose = [], engine_module.propose

    def recording(*args):
        drafted = propose(*args)
        sources.extend(d.source for d in drafted.drafts.values())
        return drafted

    monkeypatch.setattr(engine_module, "propose", recording)
    params = SamplingParams(max_tokens=120, structured=StructuredOutput(json=LONG_KEYS))
    assert run_staggered(llm, PROMPTS, [params] * 4) == plain_json
    assert sources.count(GRAMMAR) >= 4 * 3, sources  # each request's three keys, at least
    m = llm.engine.speculation.metrics
    assert m.accepted_per_position[3] > 0, m  # long keys: four forced tokens accepted in one step
    configured = {method} if isinstance(method, str) else set(method)
    assert set(sources) <= configured | {GRAMMAR} and set(m.by_source) <= configured | {GRAMMAR}, m.by_source


@pytest.fixture(scope="module")
def plain_text(tiny_qwen):
    return [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_a_right_prediction_is_accepted_and_a_wrong_one_changes_nothing(method, tiny_qwen, tiny_qwen_draft,
                                                                        plain_text):
    llm = make(tiny_qwen, spec_of(method, tiny_qwen_draft))
    # the prediction: the plain output with one token changed in the middle (an edit), as token ids
    predictions = [t[:20] + [(t[20] + 1) % 200] + t[21:] for t in plain_text]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=40, ignore_eos=True, prediction=p) for p in predictions])
    assert [o.token_ids for o in outs] == plain_text
    assert all(o.speculation.accepted_prediction_tokens >= 24 for o in outs)  # realigned after the edit
    assert sum(o.speculation.rejected_prediction_tokens for o in outs) >= 1  # the edit was drafted, rejected
    for o in outs:  # the counters by source ([drafts, draft tokens, accepted]) add up, the prediction's among them
        by_source = o.speculation.by_source
        assert by_source["prediction"][2] == o.speculation.accepted_prediction_tokens
        assert sum(c[1] for c in by_source.values()) == o.speculation.num_draft_tokens
    wrong = llm.generate(PROMPTS, [SamplingParams(max_tokens=40, ignore_eos=True, prediction="zzzz qqqq " * 8)] * 4)
    assert [o.token_ids for o in wrong] == plain_text
    assert not llm.engine.hints.predictions  # finished requests let their predictions go


def test_text_predictions_are_tokenized_and_hints_prefer_the_grammar(tiny_qwen):
    llm = make(tiny_qwen)
    hints = RequestHints()
    req = Request("r", llm.engine.tokenize("x"), SamplingParams())
    text_ids = llm.engine.tokenizer("def f():", add_special_tokens=False).input_ids
    hints.add_prediction("r", text_ids)
    (hint,) = hints.step_hints([req], {}, 4)
    assert hint.source == PREDICTION and hint.tree.tokens == text_ids[:4]
    grammar = llm.engine.grammar_compiler.matcher(StructuredOutput(json=LONG_KEYS))
    (hint,) = hints.step_hints([req], {"r": grammar}, 8)
    assert llm.engine.tokenizer.decode(hint.tree.tokens) == "{"  # then a blank or a quote: the model's choice
    grammar.commit(llm.engine.tokenizer.encode('{"', add_special_tokens=False))
    (hint,) = hints.step_hints([req], {"r": grammar}, 8)
    forced = llm.engine.tokenizer.decode(hint.tree.tokens)
    assert hint.source == GRAMMAR and forced.startswith("custom") and 'customer_full_name"'.startswith(forced)
    assert hints.step_hints([req], {}, 0) is None  # no room for drafts: no hint
    assert RequestHints().step_hints([req], {}, 4) is None  # no hints anywhere: steps plan as before


def test_sampled_requests_with_hints_are_seeded_and_valid(tiny_qwen, tiny_qwen_draft):
    spec = spec_of(["draft_model", "suffix"], tiny_qwen_draft)
    params = SamplingParams(max_tokens=100, temperature=0.8, seed=2, structured=StructuredOutput(json=LONG_KEYS),
                            prediction='{"customer_full_name": "ab", "order_identifier_number": 7}')
    a = [o.text for o in make(tiny_qwen, spec).generate(PROMPTS, params)]
    assert a == [o.text for o in make(tiny_qwen, spec).generate(PROMPTS, params)]
    assert all(re.match(r'\{\s*"customer_full_name"\s*:\s*"', t) for t in a), a
