"""Incremental detokenisation and stop strings."""
from __future__ import annotations

from smartspec.types.request import Request

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21: every text by decode
    DecodeStream = None


def append_text(tokenizer, req: Request, end: int | None = None) -> str:
    """Decode the request's newest output tokens (up to output token `end`, default all) into req.text; return the
    new text.

    Only the tokens since the last complete character are decoded again (a token may end inside a UTF-8
    sequence, which decodes to U+FFFD until the rest arrives)."""
    ids, base = req.token_ids, len(req.prompt_token_ids)  # sliced in place: not a copy of every output token
    end = len(ids) - base if end is None else end
    prefix = decode(tokenizer, ids[base + req.detok_prefix_offset:base + req.detok_read_offset])
    full = decode(tokenizer, ids[base + req.detok_prefix_offset:base + end])
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix):]
    req.detok_prefix_offset, req.detok_read_offset = req.detok_read_offset, end
    req.text += delta
    return delta


def append_step_text(tokenizer, req: Request, count: int) -> None:
    """append_text after each of the request's last `count` tokens, for a request whose text no stop string is
    looked for in. Where the tokenizer's Rust decoder is the text (decode's fast path), by its incremental decoder
    (tokenizers' DecodeStream: the same windows as append_text's, kept in Rust; a quarter of two decodes a token),
    one token at a time. Else all of them in one decode where that ends on a whole character (two decodes a step,
    not two a token), else token by token, so that the text of the tokens before a split character is not held
    back."""
    backend = _streaming_backend(tokenizer)
    if backend is not None:
        step, ids = _stream_of(req).step, req.token_ids
        req.text += "".join(filter(None, [step(backend, ids[i]) for i in range(len(ids) - count, len(ids))]))
        return
    if append_text(tokenizer, req) or count <= 1:
        return
    total = req.num_output_tokens
    for end in range(total - count + 1, total + 1):
        append_text(tokenizer, req, end)


def append_token_text(tokenizer, req: Request) -> str:
    """append_text for the request's newest token (a request whose text stop strings are looked for in, a token at
    a time): by the Rust decoder's stream where it gives the text (append_step_text)."""
    backend = _streaming_backend(tokenizer)
    if backend is None:
        return append_text(tokenizer, req)
    delta = _stream_of(req).step(backend, req.token_ids[-1]) or ""
    req.text += delta
    return delta


def _stream_of(req: Request):
    """The request's incremental decoder, made at its first output token."""
    if req.detok_stream is None:
        req.detok_stream = DecodeStream(skip_special_tokens=True)
    return req.detok_stream


def _streaming_backend(tokenizer):
    """The Rust tokenizer whose incremental decoder gives the request's text (None: decode's other path)."""
    if DecodeStream is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    return getattr(tokenizer, "backend_tokenizer", None)


def decode(tokenizer, token_ids: list[int]) -> str:
    """tokenizer.decode(token_ids, skip_special_tokens=True): by its Rust tokenizer directly where transformers
    would add nothing to that text (no clean-up of spaces), for transformers' wrapper around it, two calls a token
    of every request, cost more than the rest of committing the token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode(token_ids, skip_special_tokens=True)
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def find_stop(req: Request, new_text: str) -> int | None:
    """Where the earliest stop string starts in req.text, if one ends inside the new text."""
    if not req.params.stop or not new_text:
        return None
    window_start = max(0, len(req.text) - len(new_text) - max(map(len, req.params.stop)) + 1)
    hits = [i for s in req.params.stop if (i := req.text.find(s, window_start)) >= 0]
    return min(hits) if hits else None
