"""Sampling controls that reshape a request's logits from its history: presence, frequency and repetition
penalties, logit_bias and min_tokens (min_p acts on probabilities, in sampler.target_probs).

Each logits row is reshaped with the history it has in plain decoding: the prompt, the output so far and, under
speculation, the draft tokens before that row's position. Verification then checks the very distribution plain
decoding samples from, so greedy speculation stays token-for-token equal and sampled speculation exact.

A step reshapes the rows of all its controlled requests together (`reshape_rows`): the same elementwise operations
on every row, each with its own request's values, so a row comes out bitwise the same whatever else the batch
holds (a control a request does not use leaves its rows exactly as they were: x / 1, x * 1, x - 0 and a where()
that keeps x), and the step sends what the controls read to the device in one copy, not a few per request."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from smartspec.runtime.token_counts import CountRequest, TokenCounts
from smartspec.runtime.upload import HostBatch
from smartspec.types.sampling_params import SamplingParams


@dataclass(frozen=True)
class ControlledRows:
    """One request's rows to reshape: its sampling controls, its prompt and output so far, and each row's draft
    prefix (row i follows prompt + output + prefixes[i])."""
    params: SamplingParams
    prompt: list[int]
    output: Sequence[int]
    prefixes: list[list[int]]
    key: str | None = None  # its history's row in a TokenCounts kept between steps (the request id)

    def ends(self, eos_token_ids: Collection[int]) -> list[int]:
        """The tokens min_tokens holds back: its stop tokens and, unless it ignores them, the model's ends."""
        p = self.params
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))

    def early_rows(self) -> list[int]:
        """Its rows that come before min_tokens, where no end may come."""
        done = len(self.output)
        return [i for i, prefix in enumerate(self.prefixes) if done + len(prefix) < self.params.min_tokens]


class _Gathered:
    """What the controls read, gathered over the requests as flat lists (sent in one copy, integers and floats
    together): per request, its rows; per row, its request and its penalties."""

    def __init__(self, requests: list[ControlledRows], eos_token_ids: Collection[int], vocab: int,
                 kept: bool) -> None:
        """kept: the histories are counted in rows kept between steps, by request key (else by position)."""
        self.vocab, self.kept = vocab, kept
        self.row_request: list[int] = []
        self.counted: list[CountRequest] = []  # the histories the penalties count (token_counts.py)
        self.row_counted: list[int] = []  # per row: its request's history among `counted` (0: it counts none)
        self.drafted: tuple[list[int], list[int]] = ([], [])  # (row, token) of every draft token before a row
        self.biased: tuple[list[int], list[int]] = ([], [])  # (request, token) of logit_bias
        self.held: tuple[list[int], list[int]] = ([], [])  # (row, token) set to -inf by min_tokens
        self.bias: list[float] = []
        self.penalties: list[float] = []  # per row: repetition, frequency, presence
        self.uses: set[str] = set()  # the penalties some request uses: "repetition", "frequency", "presence"
        for q, r in enumerate(requests):
            self._add(q, r, eos_token_ids)

    def _add(self, q: int, r: ControlledRows, eos_token_ids: Collection[int]) -> None:
        p, first, n = r.params, len(self.row_request), len(r.prefixes)
        self.row_request += [q] * n
        penalties = (p.repetition_penalty, p.frequency_penalty or 0.0, p.presence_penalty or 0.0)
        self.penalties += penalties * n
        used = {name for name, value, neutral in zip(("repetition", "frequency", "presence"), penalties, (1.0, 0, 0))
                if value != neutral}
        self.row_counted += [len(self.counted) if used else 0] * n
        if used:  # the penalties count what came before each row
            self.uses |= used
            key = r.key if self.kept else q
            if key is None:
                raise ValueError("a request whose history is kept between steps needs its key")
            self.counted.append(CountRequest(key, r.prompt, r.output, "repetition" in used))
            for i, prefix in enumerate(r.prefixes):
                self.drafted[0].extend([first + i] * len(prefix))
                self.drafted[1].extend(prefix)
        if bias := {t: b for t, b in p.logit_bias.items() if t < self.vocab}:
            self.biased[0].extend([q] * len(bias))
            self.biased[1].extend(bias)
            self.bias.extend(bias.values())
        if p.min_tokens and (ends := [t for t in r.ends(eos_token_ids) if t < self.vocab]):
            for i in r.early_rows():
                self.held[0].extend([first + i] * len(ends))
                self.held[1].extend(ends)


class StagedControls:
    """What reshaping a batch of requests' rows reads, gathered on the host and staged in a HostBatch: `rows` (the
    step's logits rows that are theirs, or None: the logits given are theirs), the row -> request map, the
    penalized histories' update (token_counts.py) with each row's history, the (index, token) pairs of drafts, bias
    and min_tokens, the penalties and the bias values. reshape_staged reads them once the batch is sent.

    counts: the histories kept between steps, each request's under its key (None: counted here from the whole
    history, in rows of this call alone)."""

    def __init__(self, requests: list[ControlledRows], eos_token_ids: Collection[int], vocab: int,
                 rows: list[int] | None, batch: HostBatch, device: torch.device,
                 counts: TokenCounts | None = None) -> None:
        self.requests, self.rows = requests, rows
        self.gathered = g = _Gathered(requests, eos_token_ids, vocab, kept=counts is not None)
        if rows is not None and len(g.row_request) != len(rows):
            raise ValueError(f"{len(rows)} logits rows for requests whose prefixes make {len(g.row_request)}")
        self.counts = counts if counts is not None else TokenCounts()
        self.staged_counts = self.counts.stage(g.counted, vocab, device, batch) if g.uses else None
        row_slots = [] if self.staged_counts is None else [self.staged_counts.slots[i] for i in g.row_counted]
        pairs = [g.drafted, g.biased, g.held]
        self.ints = [batch.ints(part) for part in [rows or [], g.row_request, row_slots,
                                                   *(p for pair in pairs for p in pair)]]
        self.penalties, self.bias = batch.floats(g.penalties), batch.floats(g.bias)


def reshape_rows(logits: torch.Tensor, requests: list[ControlledRows], eos_token_ids: Collection[int] = (),
                 rows: list[int] | None = None) -> torch.Tensor:
    """logits [R, V]: the rows of `requests` in order (R = their prefixes together); or, with `rows`, the step's
    logits, whose rows `rows` are theirs (taken in the same copy as the controls' values). Returns the requests' rows
    reshaped, float32. Token ids past V (a draft whose vocabulary is padded shorter than the target's) are left out.
    Each history is counted whole (no counts kept). A stage that sends other values too stages these with them
    (StagedControls) and calls reshape_staged."""
    batch = HostBatch()
    staged = StagedControls(requests, eos_token_ids, logits.shape[1], rows, batch, logits.device)
    return reshape_staged(logits, staged, batch.send(logits.device))


def reshape_staged(logits: torch.Tensor, staged: StagedControls, sent: list[torch.Tensor]) -> torch.Tensor:
    """reshape_rows with its values staged (StagedControls) and sent (HostBatch.send's answer).

    Order as in vLLM and transformers: the penalties, then the bias, then min_tokens' mask; counts are exact
    integers, so a row reshaped here is bitwise the row plain decoding reshapes at that position. A row of a
    request without penalties reads another's history with neutral penalties (x / 1, x * 1, x - 0: x itself)."""
    g, vocab, dev, n = staged.gathered, logits.shape[1], logits.device, len(staged.requests)
    if staged.rows is None and len(g.row_request) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for requests whose prefixes make {len(g.row_request)}")
    ints = [sent[key] for key in staged.ints]
    penalties, bias = sent[staged.penalties].view(-1, 3), sent[staged.bias]
    x = logits.to(torch.float32, copy=True) if staged.rows is None else logits[ints[0]].float()
    row_request, row_slots, drafted, biased, held = ints[1], ints[2], ints[3:5], ints[5:7], ints[7:9]
    if staged.staged_counts is not None:  # the history's tokens past V counted in a column of their own, cut off
        output, prompt = staged.counts.apply(staged.staged_counts, sent)
        counts = output[row_slots]
        if g.drafted[0]:
            counts.index_put_((drafted[0], drafted[1].clamp(max=vocab)), torch.ones((), device=dev), accumulate=True)
        counts = counts[:, :vocab]
        repetition, frequency, presence = (penalties[:, j:j + 1] for j in range(3))
        if "repetition" in g.uses:
            seen = (counts > 0) | prompt[row_slots, :vocab]
            x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        if "frequency" in g.uses:
            x -= frequency * counts
        if "presence" in g.uses:
            x -= presence * (counts > 0).float()
    if g.bias:
        values = torch.zeros(n, vocab, device=dev).index_put_(tuple(biased), bias)
        marked = torch.zeros(n, vocab, device=dev, dtype=torch.bool).index_put_(
            tuple(biased), torch.ones((), device=dev, dtype=torch.bool))
        x = torch.where(marked[row_request], x + values[row_request], x)
    if g.held[0]:
        x.index_put_(tuple(held), torch.full((), float("-inf"), device=dev))
    return x

