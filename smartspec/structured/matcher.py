"""A request's grammar as a matcher (llguidance): which tokens may come next after the committed output and after
each draft prefix, how far a draft stays valid, and the tokens the grammar forces.

llguidance over xgrammar: on the Qwen2.5 vocabulary both compute a mask in a small share of a decode step
(`scripts/bench_structured.py --parts mask`; a grammar's cost per step: docs/benchmarks.md); llguidance installs
with no dependencies (xgrammar pulls triton into a CPU install), rolls back consumed tokens (rejected drafts) and
reports the tokens and bytes a grammar forces (`forced_tokens`: jump-forward)."""
from __future__ import annotations

import threading
from collections.abc import Collection
from typing import NamedTuple

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from smartspec.runtime.upload import HostBatch
from smartspec.structured.compile import TOOL_CALL_TAGS, grammar_of, refuse_invalid
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
                                        for t in TOOL_CALL_TAGS)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                ends = self.end_token_ids or None
                try:  # the model's vocabulary (often padded past the tokenizer's)
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=ends)
                except ValueError:  # a tokenizer that counts more ids than the model's logits: its own size
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=ends)
            return self._tokenizer

    def warm(self) -> None:
        """Build the tokenizer view and run one grammar's first mask, so the first structured request does not
        (seconds on a 150k vocabulary, which would stall the step thread and every request in its batch). Safe
        beside steps: the tokenizer is built under the lock that the first request would wait on."""
        grammar = self.matcher(StructuredOutput(json={"type": "object"}))
        grammar.masks([[]])

    def check(self, spec: StructuredOutput) -> None:
        """A Lark grammar (a request's own, or tool calls') checked against this tokenizer: the special tokens it
        names must be this model's (the front checked the rest without a tokenizer). Raises ParamError, a 400,
        before the request is queued rather than a failure inside the step."""
        if spec.grammar is None and spec.tool_calls is None:
            return
        grammar, field = grammar_of(spec, self.tool_tags_are_tokens)
        refuse_invalid(grammar, field, field.split(".")[-1], self.tokenizer())

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        grammar, field = grammar_of(spec, self.tool_tags_are_tokens)
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ParamError(field, f"invalid {field.split('.')[-1]}: {matcher.get_error()[:300]}")
        return RequestGrammar(matcher, self.tokenizer())


class GrammarRefusedToken(RuntimeError):
    """The grammar refused a token the step committed: an inconsistency inside structured output, never the
    caller's input. The request it happened to ends (finish reason "error"); the engine and the batch go on."""


class RequestGrammar:
    """A request's grammar state at its committed tokens. Drafts are walked into it and rolled back, so between
    steps it always stands at the committed output."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> None:
        self.matcher, self.tokenizer, self.vocab_size = matcher, tokenizer, tokenizer.vocab_size

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the output."""
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens, from the committed state, the grammar allows in a row."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced_tokens(self) -> tuple[list[int], int]:
        """The tokens the grammar forces from here (keys, braces, `": "`), and how many of them are certain.

        llguidance's forced tokens stop where the next token is ambiguous (after `":`, the value may begin in the
        same token as ` "`); the forced bytes go on. Their usual tokenization follows, as likely tokens: the
        target verifies them like any draft, and where it tokenizes otherwise they are simply rejected."""
        if self.matcher.is_stopped():
            return [], 0
        tokens = list(self.matcher.compute_ff_tokens())
        certain = len(tokens)
        forced, done = self.matcher.compute_ff_bytes(), self.tokenizer.decode_bytes(tokens)
        if len(forced) > len(done) and forced.startswith(done):
            tail = self.tokenizer.tokenize_bytes(forced[len(done):])
            tokens += tail[:self.valid_prefix(tokens + tail) - certain]
        return tokens, certain

    def masks(self, prefixes: list[list[int]]) -> tuple[torch.Tensor, list[bool]]:
        """Bitmasks [n, ceil(V / 32)] of the tokens allowed after each prefix (draft tokens after the committed
        ones), and whether each prefix is valid (an invalid one gets no mask: its row is never used)."""
        bitmask = empty_masks(len(prefixes), self.vocab_size)
        return bitmask, self.fill_masks(prefixes, bitmask, 0)

    def fill_masks(self, prefixes: list[list[int]], bitmask: torch.Tensor, first: int) -> list[bool]:
        """masks() into rows first, first + 1, ... of a bitmask that holds other requests' rows too (a step's
        structured requests are unpacked and applied together: apply_masks); whether each prefix is valid."""
        # each row filled at its address (what llguidance.torch.fill_next_token_bitmask computes from a row view:
        # a view and its checks a row were most of this loop's host operations), the bounds checked here once
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() or not bitmask.is_cpu:
            raise ValueError("bitmasks are a contiguous int32 [rows, words] host tensor")
        if not 0 <= first <= first + len(prefixes) <= bitmask.shape[0]:
            raise IndexError(f"rows {first}..{first + len(prefixes) - 1} past a bitmask of {bitmask.shape[0]} rows")
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        base = bitmask.data_ptr() + first * row_bytes
        valid = []
        for i, prefix in enumerate(prefixes):
            taken = self.matcher.try_consume_tokens(prefix) if prefix else 0  # stops at a forbidden token
            valid.append(taken == len(prefix))
            if valid[-1]:
                self.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
            if taken:
                self.matcher.rollback(taken)
        return valid

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, from the committed state: a bool tensor [V]."""
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        return allowed_tokens(bitmask, self.vocab_size)[0]

    def commit(self, tokens: list[int]) -> None:
        """The request took these tokens (each one its masked distribution allowed)."""
        if tokens and not self.matcher.consume_tokens(tokens):
            raise GrammarRefusedToken(f"grammar refused committed tokens {tokens}: {self.matcher.get_error()[:500]}")


def empty_masks(rows: int, vocab_size: int) -> torch.Tensor:
    """Bitmasks [rows, ceil(V / 32)] that allow every token, for grammars to fill (RequestGrammar.fill_masks)."""
    return llguidance.torch.allocate_token_bitmask(rows, vocab_size)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab_size] bool: bit j of word w of each row's bitmask allows token 32 w + j (none past the mask's
    32 W tokens: logits wider than the tokenizer's vocabulary)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no copy from the host
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] < vocab_size:
        return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    return bits[:, :vocab_size]


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, valid: list[bool]) -> None:
    """Disallowed tokens' logits to -inf, in place, on the rows with a valid prefix. Unpacked eagerly, not by
    llguidance's torch.compile'd kernel: that compiled on a process's first structured request and again on its
    first with another row count (0.2-2 s on a CPU, the whole batch's step stalled), for no gain at a few rows.
    A stage that sends other values too stages the masks with them (StagedMasks) and calls apply_staged_masks."""
    batch = HostBatch()
    staged = StagedMasks.of(bitmask, valid, batch)
    if staged is not None:
        apply_staged_masks(logits, staged, batch.send(logits.device))


class StagedMasks(NamedTuple):
    """The bitmask and the rows it applies to, staged in a HostBatch (keys into what it sends)."""
    bits: int
    rows: int | None  # None: every row

    @classmethod
    def of(cls, bitmask: torch.Tensor, valid: list[bool], batch: HostBatch) -> StagedMasks | None:
        """None where no row has a valid prefix (nothing to mask)."""
        rows = [i for i, ok in enumerate(valid) if ok]
        if not rows:
            return None
        return cls(batch.ints(bitmask), None if len(rows) == len(valid) else batch.ints(rows))


def apply_staged_masks(logits: torch.Tensor, staged: StagedMasks, sent: list[torch.Tensor]) -> None:
    """apply_masks with its bitmask and rows staged (StagedMasks.of) and sent (HostBatch.send's answer)."""
    bits = sent[staged.bits]
    if staged.rows is None:
        logits.masked_fill_(~allowed_tokens(bits, logits.shape[1]), float("-inf"))
        return
    index = sent[staged.rows]
    logits[index] = logits[index].masked_fill(~allowed_tokens(bits, logits.shape[1])[index], float("-inf"))
