"""The engine's incremental detokenizer: its decode is the tokenizer's own decode, token for token."""
import random

import pytest

from smartspec.bench.tiny_models import byte_tokenizer
from smartspec.engine.detokenizer import append_text, decode
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams


def test_decode_is_the_tokenizers_own_text_with_or_without_clean_up():
    rng = random.Random(0)
    for clean_up in (False, True):  # the Rust tokenizer directly, or transformers' decode where it cleans up
        tokenizer = byte_tokenizer()
        tokenizer.clean_up_tokenization_spaces = clean_up
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]  # <eos>, broken UTF-8 too
            assert decode(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_append_text_yields_whole_characters_that_add_up_to_the_decoded_output():
    tokenizer = byte_tokenizer()
    text = "héllo wörld, 你好 🙂!"
    ids = tokenizer(text)["input_ids"]
    req = Request("r", [0], SamplingParams(max_tokens=len(ids)))
    deltas = []
    for token in ids:
        req.token_ids.append(token)
        deltas.append(append_text(tokenizer, req))
    assert "".join(deltas) == req.text == text and not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # a token that ends inside a character waits for the rest


def random_steps(ids: list[int], rng: random.Random):
    """The ids in steps of 1 to 5 tokens: (tokens so far, the step's)."""
    at = 0
    while at < len(ids):
        step = ids[at:at + rng.randint(1, 5)]
        at += len(step)
        yield at, step


@pytest.mark.parametrize("clean_up", [False, True])  # the Rust decoder's stream, or decodes of a step's tokens
def test_a_steps_tokens_decoded_at_once_give_the_text_token_by_token_gives(clean_up):
    """A request without stop strings decodes a step's tokens at once: the same text after every step as one
    decoded token by token, a character split across steps or inside one included."""
    from smartspec.engine.detokenizer import append_step_text

    tokenizer = byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = clean_up
    rng = random.Random(1)
    ids = tokenizer("naïve café — 東京 🙂🙂 ok, ß!")["input_ids"]
    for _ in range(20):
        by_token, at_once = (Request(name, [0], SamplingParams(max_tokens=len(ids))) for name in ("a", "b"))
        for at, step in random_steps(ids, rng):
            for token in step:
                by_token.token_ids.append(token)
                append_text(tokenizer, by_token)
            at_once.token_ids.extend(step)
            append_step_text(tokenizer, at_once, len(step))
            assert at_once.text == by_token.text, (at, step)
        assert at_once.text == tokenizer.decode(ids)
        assert (at_once.detok_stream is not None) == (not clean_up)  # the path the test is about ran


def test_the_streamed_text_of_any_tokens_is_append_texts_after_every_step():
    """Random token ids (the end-of-sequence token, bytes that never make a character, characters split across
    steps) in random steps: the text by the Rust decoder's stream equals append_text's after every step, and each
    token's own text (a request with stop strings) is append_text's for that token."""
    from smartspec.engine.detokenizer import append_step_text, append_token_text

    tokenizer = byte_tokenizer()
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 24))]
        by_token, streamed, each = (Request(name, [0], SamplingParams(max_tokens=len(ids))) for name in "abc")
        for at, step in random_steps(ids, rng):
            for token in step:
                by_token.token_ids.append(token)
                expected = append_text(tokenizer, by_token)
                each.token_ids.append(token)  # a request with stop strings: each token's text on its own
                assert append_token_text(tokenizer, each) == expected, ids[:at]
            streamed.token_ids.extend(step)
            append_step_text(tokenizer, streamed, len(step))
            assert streamed.text == by_token.text == each.text, ids[:at]
