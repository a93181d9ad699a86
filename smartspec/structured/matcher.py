"""A request's grammar as a matcher (llguidance): which tokens may come next after the committed output and after
each draft prefix, how far a draft stays valid, and the tokens the grammar forces.

llguidance over xgrammar: on the 151,936-token Qwen2.5 vocabulary on this project's CPUs both compute a mask in
well under 0.1 ms a token (docs/benchmarks.md, `scripts/bench_grammar.py`), a thousandth of a decode step;
llguidance installs with no dependencies (xgrammar pulls triton into a CPU install), rolls back consumed tokens
(rejected drafts) and reports the tokens a grammar forces (`forced_tokens`)."""
from __future__ import annotations

import threading
from collections.abc import Collection

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from smartspec.structured.compile import grammar_of
from smartspec.types.sampling_params import ParamError, StructuredOutput


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it (built on first use; ~1.4 s for Qwen2.5's vocabulary)
    and, per request, a `RequestGrammar`."""

    def __init__(self, tokenizer, vocab_size: int, end_token_ids: Collection[int]) -> None:
        self._hf, self.vocab_size, self.end_token_ids = tokenizer, vocab_size, sorted(end_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        # Qwen2.5's tool-call tags are tokens of their own; a tokenizer without them spells them out
        self.tool_tags_are_tokens = all(len(tokenizer.encode(t, add_special_tokens=False)) == 1
                                        for t in ("<tool_call>", "</tool_call>"))

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                ends = self.end_token_ids or None
                try:  # the model's vocabulary (often padded past the tokenizer's)
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=ends)
                except ValueError:  # a tokenizer that counts more ids than the model's logits: its own size
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=ends)
            return self._tokenizer

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        grammar, field = grammar_of(spec, self.tool_tags_are_tokens)
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ParamError(field, f"invalid {field.split('.')[-1]}: {matcher.get_error()[:300]}")
        return RequestGrammar(matcher, self.tokenizer().vocab_size)


class RequestGrammar:
    """A request's grammar state at its committed tokens. Drafts are walked into it and rolled back, so between
    steps it always stands at the committed output."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the output."""
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens, from the committed state, the grammar allows in a row."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (keys, braces, `": "`)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    def masks(self, prefixes: list[list[int]]) -> tuple[torch.Tensor, list[bool]]:
        """Bitmasks [n, ceil(V / 32)] of the tokens allowed after each prefix (draft tokens after the committed
        ones), and whether each prefix is valid (an invalid one gets no mask: its row is never used)."""
        bitmask = llguidance.torch.allocate_token_bitmask(len(prefixes), self.vocab_size)
        valid = []
        for i, prefix in enumerate(prefixes):
            ok = self.valid_prefix(prefix) == len(prefix)
            valid.append(ok)
            if not ok:
                continue
            if prefix:
                self.matcher.consume_tokens(prefix)
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, i)
            if prefix:
                self.matcher.rollback(len(prefix))
        return bitmask, valid

    def commit(self, tokens: list[int]) -> None:
        """The request took these tokens (each one its masked distribution allowed)."""
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"grammar refused committed tokens {tokens}: {self.matcher.get_error()}")


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, valid: list[bool]) -> None:
    """Disallowed tokens' logits to -inf, in place, on the rows with a valid prefix."""
    rows = [i for i, ok in enumerate(valid) if ok]
    if not rows:
        return
    if len(rows) == len(valid):
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return
    sub = logits[rows]
    llguidance.torch.apply_token_bitmask_inplace(sub, bitmask[rows].to(logits.device))
    logits[rows] = sub
