"""Structured outputs: JSON schemas, JSON mode, regexes, choices and grammars (llguidance) hold on every output, with
and without speculation; greedy structured output is the same token for token either way; a draft is cut at the
first token its grammar forbids, and a cut sampled draft still yields the target's distribution (chi-square)."""
import json
import re

import jsonschema
import pytest
import torch
from chi_square import CHI2_CRIT, chi2
from engines import METHODS, PROMPTS, make, mixed_spec, run_staggered

from smartspec import SamplingParams
from smartspec.engine.drafter import Drafted, cut_to_grammars
from smartspec.runtime.sampler import target_probs
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept_sampled
from smartspec.structured.compile import closed_objects, compiled, json_layout
from smartspec.types.sampling_params import ParamError, StructuredOutput
from smartspec.types.tree import TokenTree

K, V = 3, 6  # a sampled draft of K tokens over a vocabulary of V

WORD = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"customer_full_name": WORD, "order_identifier": {"type": "integer",
     "minimum": 1, "maximum": 9999}, "express_delivery": {"type": "boolean"}},
     "required": ["customer_full_name", "order_identifier", "express_delivery"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "when": {"type": "string", "pattern":
     "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["kind", "when"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
     {"type": "null"}]}}, "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"type": "object",
     "properties": {"sku": WORD, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"],
     "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "priority": {"type": "integer",
     "minimum": 1, "maximum": 5}, "title": WORD}, "required": ["status", "priority", "title"],
     "additionalProperties": False},
]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (160, 140, 150, 120)]


def structured(params: list[SamplingParams], spec: StructuredOutput) -> list[SamplingParams]:
    return [SamplingParams(**{**p.__dict__, "structured": spec}) for p in params]


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return make(tiny_qwen)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_json_schema_outputs_validate(plain, schema):
    for out in plain.generate(PROMPTS, structured(PARAMS, StructuredOutput(json=schema))):
        assert out.finish_reason == "stop", out.text  # the grammar completed, before the length limit
        jsonschema.validate(json.loads(out.text), schema)


def test_json_mode_answers_are_objects(plain):
    """JSON mode: any object. A random model's free keys rarely close, so '"' is favoured (logit_bias, a sampling
    control like any other); every answer is an object the grammar completed, not only empty ones."""
    quote = plain.engine.tokenizer.encode('"', add_special_tokens=False)[0]
    params = [SamplingParams(**{**p.__dict__, "logit_bias": {quote: 5.0}, "structured": StructuredOutput(
        json_object=True)}) for p in PARAMS]
    outs = plain.generate(PROMPTS, params)
    assert all(o.finish_reason == "stop" and isinstance(json.loads(o.text), dict) for o in outs), [o.text for o in outs]
    assert any(json.loads(o.text) for o in outs)


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput(regex=r"[a-z]{2,6}@(example|test)\.(com|org)"),
     lambda t: re.fullmatch(r"[a-z]{2,6}@(example|test)\.(com|org)", t)),
    (StructuredOutput(choice=["positive", "negative", "neutral"]), lambda t: t in ("positive", "negative", "neutral")),
    (StructuredOutput(grammar='start: "(" num (" + " num)* ")"\nnum: /[0-9]{1,2}/'),
     lambda t: re.fullmatch(r"\([0-9]{1,2}( \+ [0-9]{1,2})*\)", t)),
    (StructuredOutput(grammar='root ::= "yes" | "no" | "maybe"'), lambda t: t in ("yes", "no", "maybe")),  # GBNF
], ids=["regex", "choice", "lark", "gbnf"])
def test_other_constraints_hold(plain, spec, check):
    for out in plain.generate(PROMPTS, structured(PARAMS, spec)):
        assert out.finish_reason == "stop" and check(out.text), out.text


SPECS = [StructuredOutput(json=SCHEMAS[0]), StructuredOutput(json=SCHEMAS[8]),
         StructuredOutput(regex=r"[a-z]{2,6}@(example|test)\.(com|org)"), StructuredOutput(choice=["alpha", "beta"])]


@pytest.fixture(scope="module")
def plain_structured(plain):
    return {i: [o.token_ids for o in plain.generate(PROMPTS, structured(PARAMS, s))] for i, s in enumerate(SPECS)}


@pytest.mark.parametrize("index", range(len(SPECS)))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_structured_speculation_equals_plain(method, index, tiny_qwen, tiny_qwen_draft, plain_structured):
    llm = make(tiny_qwen, mixed_spec(method, tiny_qwen, tiny_qwen_draft))
    assert run_staggered(llm, PROMPTS, structured(PARAMS, SPECS[index])) == plain_structured[index]
    assert not llm.engine.grammars  # finished requests let their grammars go
    m = llm.engine.speculation.metrics
    if index == 0 and method in ("suffix", "self", "self-tree"):  # rows masked after accepted draft tokens
        assert m.accepted_per_position[1] > 0, m


def test_seeded_sampled_structured_speculation_is_valid_and_reproducible(tiny_qwen, tiny_qwen_draft):
    spec = {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 3, "policy": "fixed"}
    params = structured([SamplingParams(max_tokens=160, temperature=0.9, seed=5, ignore_eos=True)],
                        StructuredOutput(json=SCHEMAS[4]))[0]
    a = [o.text for o in make(tiny_qwen, spec).generate(PROMPTS, params)]
    assert a == [o.text for o in make(tiny_qwen, spec).generate(PROMPTS, params)]
    for text in a:
        jsonschema.validate(json.loads(text), SCHEMAS[4])


class AllowedTokens:
    """A stand-in grammar over a fixed set of allowed tokens, for the draft cut alone."""

    def __init__(self, allowed):
        self.allowed = set(allowed)

    def valid_prefix(self, tokens):
        n = 0
        while n < len(tokens) and tokens[n] in self.allowed:
            n += 1
        return n


def test_drafts_are_cut_at_the_first_forbidden_token():
    q = torch.full((4, 10), 0.1)
    tree = TokenTree([1, 7, 2, 3], [-1, -1, 0, 2], [1.0] * 4)
    drafted = Drafted({"greedy": Draft([1, 2, 7, 3], None), "sampled": Draft([1, 7, 2, 3], q),
                       "first": Draft([7, 1], None), "tree": Draft(tree.tokens, None, tree),
                       "free": Draft([7, 7], None)}, 3, 0.5)
    grammars = {r: AllowedTokens([1, 2, 3]) for r in ("greedy", "sampled", "first", "tree")}
    cut = cut_to_grammars(drafted, grammars).drafts
    assert cut["greedy"] == Draft([1, 2], None)
    assert cut["sampled"].tokens == [1] and cut["sampled"].probs.shape == (2, 10)  # the cut position's q kept
    assert "first" not in cut and cut["free"] == Draft([7, 7], None)
    assert cut["tree"].tokens == [1, 2, 3] and cut["tree"].tree.parents == [-1, 0, 1]


@pytest.mark.parametrize("keep_q_row", [True, False])
def test_a_cut_sampled_draft_still_follows_the_target_distribution(keep_q_row):
    """Forbidden tokens have p = 0; the draft (which knows nothing of the grammar) draws them with q > 0. Cut with
    the cut position's q kept, the step's tokens follow p at every position; dropping that row (sampling the cut
    position from p) is wrong, and the same test catches it."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    logits[:, [1, 4]] = float("-inf")  # the grammar forbids tokens 1 and 4 everywhere
    p = target_probs(logits, params)
    q = target_probs(torch.randn(K, V, generator=g) * 1.5, params)
    by_index = [[] for _ in range(K + 1)]
    for _ in range(12000):
        draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(K)]
        n = next((j for j, t in enumerate(draft) if t in (1, 4)), K)
        rows = q[:n + 1] if keep_q_row and n < K else q[:n]
        for j, tok in enumerate(accept_sampled(p, draft[:n], rows, g)):
            by_index[j].append(tok)
    stats = [chi2(s, p[j]) for j, s in enumerate(by_index) if len(s) > 500]
    assert len(stats) >= 3
    assert (max(stats) < CHI2_CRIT) == keep_q_row, stats


def admits(llm, spec: StructuredOutput, text: str) -> bool:
    """The spec's grammar takes the whole text and may end there."""
    grammar = llm.engine.grammar_compiler.matcher(spec)
    tokens = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return grammar.valid_prefix(tokens) == len(tokens) and (grammar.commit(tokens) or grammar.matcher.is_accepting())


def test_an_empty_schema_admits_any_json_value_not_only_objects(plain):
    """{} is JSON Schema's "anything": a grammar of one JSON value of any type (JSON mode's is objects only)."""
    for text in ('[1, "a"]', '"word"', "42", '{"a": 1}'):
        assert admits(plain, StructuredOutput(json={}), text), text
    assert admits(plain, StructuredOutput(json_object=True), '{"a": 1}')
    assert not admits(plain, StructuredOutput(json_object=True), "42")


def test_json_takes_the_whitespace_a_model_writes_bounded_and_compact_on_request(plain):
    """The default layout admits JSON pretty-printed or on one line, as a model writes it, but no free runs of
    blanks (a model pads with them); a schema's own x-guidance asking for the compact layout admits one line only."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items":
                                                                                  {"type": "integer"}}}}
    pretty = json.dumps({"a": 1, "b": [2, 3]}, indent=2)
    assert admits(plain, StructuredOutput(json=schema), pretty)
    assert admits(plain, StructuredOutput(json=schema), json.dumps({"a": 1, "b": [2, 3]}))
    assert admits(plain, StructuredOutput(json=schema), '{"a":1,"b":[2,3]}')
    for padded in ('{' + " " * 3 + '"a": 1}', '{"a":' + " " * 2 + '1}', '{"a": 1,\n\n  "b": []}'):
        assert not admits(plain, StructuredOutput(json=schema), padded), padded
    for own in (json_layout("compact"), {"whitespace_flexible": False}):  # the layout whole, or the docs' one key
        compact = {**schema, "x-guidance": own}
        for loose in (pretty, '{"a":1}', '{ "a": 1}'):
            assert not admits(plain, StructuredOutput(json=compact), loose), (own, loose)
        assert admits(plain, StructuredOutput(json=compact), '{"a": 1, "b": [2, 3]}')


def test_strict_schemas_close_their_objects_and_refuse_what_they_cannot_enforce(plain):
    """strict (the default, OpenAI's json_schema.strict): an object that lists its properties takes no others;
    strict false reads the schema as JSON Schema does (open objects) and ignores keywords it cannot enforce."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "inner": {"type": "object", "properties":
                                                                                     {"b": {"type": "string"}}}}}
    extra_inside, extra_outside = '{"a": 1, "inner": {"b": "x", "c": 2}}', '{"a": 1, "z": true}'
    for text in (extra_inside, extra_outside):
        assert not admits(plain, StructuredOutput(json=schema), text), text
        assert admits(plain, StructuredOutput(json=schema, strict=False), text), text
    assert admits(plain, StructuredOutput(json=schema), '{"a": 1, "inner": {"b": "x"}}')
    odd = {"type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(ParamError) as err:
        compiled(StructuredOutput(json=odd))
    assert err.value.field == "structured_outputs.json" and "no-such-format" in str(err.value)
    assert admits(plain, StructuredOutput(json=odd, strict=False), '{"d": "anything"}')


def test_closing_objects_reads_the_schema_not_its_property_names():
    """A property called "properties" is a name, not a keyword; allOf's members stay open (closing each would
    refuse what the others add); an object that says what else it takes keeps its word."""
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
              "$defs": {"item": {"type": "object", "properties": {"y": {}}}},
              "allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}],
              "items": {"type": "object", "properties": {"z": {}}, "additionalProperties": {"type": "integer"}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]["properties"]["properties"]) == {"x"}
    assert closed["$defs"]["item"]["additionalProperties"] is False
    assert closed["allOf"] == schema["allOf"]
    assert closed["items"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in schema  # the request's own schema is left as it came


def test_min_tokens_holds_the_end_while_the_grammar_allows_more_and_a_complete_grammar_ends(plain):
    """The contract (SamplingParams.min_tokens): the end of sequence and stop strings wait for min_tokens, but a
    grammar that is complete allows nothing more, so it ends the output there, with finish_reason "stop"."""
    held = [SamplingParams(max_tokens=40, min_tokens=12, structured=StructuredOutput(regex="[a-z]{1,200}"))] * 4
    for out in plain.generate(PROMPTS, held):
        assert len(out.token_ids) >= 12 and re.fullmatch("[a-z]+", out.text), out
    ended = [SamplingParams(max_tokens=40, min_tokens=10, structured=StructuredOutput(choice=["ab", "cd"]))] * 4
    for out in plain.generate(PROMPTS, ended):
        assert out.text in ("ab", "cd") and out.finish_reason == "stop", out


def test_grammars_warm_off_the_step_thread(tiny_qwen):
    """The replica warms structured outputs at start on a thread of its own; the first request then finds the
    grammar library's tokenizer built."""
    from smartspec.engine.async_engine import AsyncEngine

    llm = make(tiny_qwen)
    engine = AsyncEngine(engine=llm.engine)
    compiler = llm.engine.grammar_compiler
    assert compiler._tokenizer is None
    thread = engine.warm_grammars()
    thread.join(60)
    assert thread.name == "smartspec-grammar-warmup" and compiler._tokenizer is not None
    built = compiler._tokenizer
    llm.engine.add_request("hi", SamplingParams(structured=StructuredOutput(choice=["a", "b"])))
    assert compiler._tokenizer is built
    engine.close()


def test_a_requests_grammar_is_compiled_once_from_the_front_to_the_matcher(plain, monkeypatch):
    """The HTTP front compiles and checks a request's grammar; the engine's checks and its matcher reuse what the
    request carries (a tool-call grammar compiled for spelled-out tags is compiled again only for a tokenizer whose
    tags are tokens)."""
    from types import SimpleNamespace

    import smartspec.structured.compile as compile_module
    from deployments.http.protocol import CompletionRequest

    real = compile_module.llguidance
    checks = []

    class CountingMatcher:
        def __getattr__(self, name):
            return getattr(real.LLMatcher, name)

        @staticmethod
        def validate_grammar(grammar):
            checks.append(grammar)
            return real.LLMatcher.validate_grammar(grammar)

    monkeypatch.setattr(compile_module, "llguidance", SimpleNamespace(LLMatcher=CountingMatcher()))
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[0]}}})
    spec, field = body.structured()
    assert field == "response_format" and len(checks) == 1
    request_id = plain.engine.add_request("hi", SamplingParams(max_tokens=4, structured=spec))
    assert len(checks) == 1 and request_id in plain.engine.grammars
    plain.engine.abort_request(request_id)


def test_invalid_schemas_and_grammars_are_refused_naming_the_field(plain):
    bad = [(StructuredOutput(json={"type": "bogus"}), "structured_outputs.json"),
           (StructuredOutput(regex="a[b"), "structured_outputs.regex"),
           (StructuredOutput(grammar="start: ("), "structured_outputs.grammar")]
    for spec, field in bad:
        with pytest.raises(ParamError) as err:
            plain.engine.add_request("hi", SamplingParams(structured=spec))
        assert err.value.field == field, err.value
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])


def test_a_grammar_that_refuses_a_committed_token_ends_its_request_alone(plain, monkeypatch):
    """Fault injection: one request's grammar refuses a token its step committed (an inconsistency inside structured
    output). That request ends with finish_reason "error"; the engine goes on and the others are answered as they
    are alone."""
    from smartspec.structured.matcher import GrammarRefusedToken, RequestGrammar

    params = SamplingParams(max_tokens=12, ignore_eos=True, structured=StructuredOutput(regex="[a-z]{1,40}"))
    alone = plain.generate(PROMPTS[:2], [params] * 2)
    real_commit = RequestGrammar.commit
    failing = []

    def commit(self, tokens):
        if self is failing[0]:
            raise GrammarRefusedToken(f"grammar refused committed tokens {tokens}: injected")
        real_commit(self, tokens)

    engine = plain.engine
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    failing.append(engine.grammars[ids[0]])
    monkeypatch.setattr(RequestGrammar, "commit", commit)
    finished = {}
    while len(finished) < 2:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[0]].finish_reason == "error" and len(finished[ids[0]].token_ids) == 1
    assert finished[ids[1]].token_ids == alone[1].token_ids and finished[ids[1]].finish_reason == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("vocab", [64, 257, 300])
def test_masks_applied_eagerly_match_llguidance_kernel(vocab):
    """apply_masks unpacks the bitmask itself (llguidance's kernel compiles on first use): the same logits, for
    every row or some, and for logits wider than the mask's vocabulary (those tokens disallowed)."""
    import llguidance.torch

    from smartspec.structured.matcher import apply_masks

    torch.manual_seed(vocab)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    for width in (vocab, vocab + 40):
        logits = torch.randn(3, width)
        expected, ours = logits.clone(), logits.clone()
        llguidance.torch.apply_token_bitmask_inplace(expected, mask)
        apply_masks(ours, mask, [True] * 3)
        assert torch.equal(ours, expected) and torch.isinf(ours).any() and torch.isfinite(ours).any()
        expected, ours = logits.clone(), logits.clone()
        some = expected[[0, 2]]
        llguidance.torch.apply_token_bitmask_inplace(some, mask[[0, 2]])
        expected[[0, 2]] = some
        apply_masks(ours, mask, [True, False, True])
        assert torch.equal(ours, expected)


def test_masks_filled_at_row_addresses_equal_llguidances_own_fill(plain):
    """fill_masks writes each row at its address: the rows llguidance.torch.fill_next_token_bitmask fills, after
    every prefix (valid or cut by a forbidden token), in a bitmask shared with other rows; rows past it refused."""
    import llguidance.torch

    from smartspec.structured.matcher import empty_masks

    engine = plain.engine
    grammar = engine.grammar_compiler.matcher(StructuredOutput(regex="[a-c]{1,6}x"))
    ids = {c: engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcxz"}
    prefixes = [[], [ids["a"]], [ids["a"], ids["b"]], [ids["z"]], [ids["a"], ids["z"], ids["b"]], [ids["x"]]]
    ours = empty_masks(len(prefixes) + 3, engine.grammar_compiler.vocab_size)
    valid = grammar.fill_masks(prefixes, ours, 2)
    theirs = empty_masks(len(prefixes) + 3, engine.grammar_compiler.vocab_size)
    expected = []
    for i, prefix in enumerate(prefixes):
        taken = grammar.matcher.try_consume_tokens(prefix) if prefix else 0
        expected.append(taken == len(prefix))
        if expected[-1]:
            llguidance.torch.fill_next_token_bitmask(grammar.matcher, theirs, 2 + i)
        if taken:
            grammar.matcher.rollback(taken)
    assert valid == expected == [True, True, True, False, False, False]  # x needs a letter before it
    assert torch.equal(ours, theirs) and bool((ours[2] != -1).any())  # the grammar did mask rows
    with pytest.raises(IndexError):
        grammar.fill_masks(prefixes, ours, 4)
