"""Impossible constraints are refused before the request is queued, naming the field: controls under which no token
can come at a position the output must reach (structured/feasible.py). Each refusal is a proof: what has a way
through is accepted."""
import pytest
from engines import make

from smartspec import SamplingParams
from smartspec.types.sampling_params import ParamError, StructuredOutput


@pytest.fixture(scope="module")
def engine(tiny_qwen):
    return make(tiny_qwen).engine


def ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def ban(engine, text: str) -> dict[int, float]:
    return {t: -100.0 for t in ids(engine, text)}


def refusal(engine, **params) -> ParamError:
    with pytest.raises(ParamError) as err:
        engine.check_request("hello", SamplingParams(**params))
    return err.value


def test_a_grammar_of_only_the_empty_output_with_min_tokens(engine):
    err = refusal(engine, min_tokens=1, structured=StructuredOutput(regex="()"))
    assert err.field == "min_tokens" and "structured_outputs.regex" in str(err) and "first token" in str(err)


def test_logit_bias_banning_every_token_a_grammar_allows(engine):
    err = refusal(engine, logit_bias=ban(engine, "ac"), structured=StructuredOutput(choice=["ab", "cd"]))
    assert err.field == "logit_bias" and "structured_outputs.choice" in str(err)


def test_a_ban_found_along_the_grammars_only_path(engine):
    """After "a" the choice can only go on with "b", which is banned: refused at output token 1."""
    err = refusal(engine, logit_bias=ban(engine, "b"), structured=StructuredOutput(choice=["ab"]))
    assert err.field == "logit_bias" and "output token 1" in str(err)


def test_a_schema_no_value_satisfies(engine):
    err = refusal(engine, structured=StructuredOutput(json={"type": "integer", "minimum": 5, "maximum": 3}))
    assert err.field == "structured_outputs.json"


def test_logit_bias_banning_the_whole_vocabulary(engine):
    every = {t: -100.0 for t in range(engine.vocab_size)}
    assert refusal(engine, logit_bias=every).field == "logit_bias"
    but_the_end = {t: b for t, b in every.items() if t not in engine.stop_token_ids}
    err = refusal(engine, logit_bias=but_the_end, min_tokens=2)
    assert err.field == "min_tokens"


@pytest.mark.parametrize("params", [
    dict(structured=StructuredOutput(regex="()")),  # the empty output is an output
    dict(logit_bias={}, structured=StructuredOutput(choice=["ab", "ac"]), min_tokens=1),
    dict(structured=StructuredOutput(choice=["a"]), min_tokens=5),  # a complete grammar ends the output
    dict(min_tokens=3, logit_bias={0: -100.0}),
], ids=["empty-output", "a-way-through", "grammar-completes", "one-ban"])
def test_what_has_a_way_through_is_accepted(engine, params):
    engine.check_request("hello", SamplingParams(**params))


def test_a_ban_that_leaves_one_way_through_is_accepted(engine):
    engine.check_request("hello", SamplingParams(logit_bias=ban(engine, "b"),
                                                 structured=StructuredOutput(choice=["ab", "ac"])))
