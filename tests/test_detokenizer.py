"""The engine's incremental detokenizer: its decode is the tokenizer's own decode, token for token."""
import random

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
