"""Penalized requests' histories kept on the device between steps, a row each (vLLM's persistent batch, for
penalties): how often each token came in a request's output (float32: exact integers), and which tokens its prompt
holds (the repetition penalty's). A step stages only the output tokens that came since the request's row was last
brought up to date (its prompt once), so what the penalties send and count each step does not grow with the
requests' lengths (counted whole, 8 penalized requests of 3,000 tokens cost a 64-request step more than 3 ms).

A row is trusted only once the step that filled it has run its update (`apply`): a row staged and never applied
(its stage failed) is filled again from nothing the next time, and one whose update failed is forgotten. An
output is only ever appended to while its request lives (a preempted request keeps its tokens), so the tokens
since the count are `output[counted:]`; a row whose key comes back with another request's prompt (an id used again
after its request ended unreleased), or with an output shorter than its count, is counted again from nothing."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from smartspec.runtime.upload import HostBatch


class CountRequest(NamedTuple):
    """What staging reads of one request: its key (the request id), its prompt and output so far, and whether its
    prompt is counted (the repetition penalty)."""
    key: str | int
    prompt: Sequence[int]
    output: Sequence[int]
    with_prompt: bool


class StagedCounts(NamedTuple):
    """A step's staged update (keys into the step's HostBatch) and what the host records once it has run."""
    slots: list[int]  # per request staged, its row
    fresh: int  # key: the rows cleared first (taken now, or never applied)
    counted: tuple[int, int]  # keys: (row, token) of every output token since a row's count
    prompted: tuple[int, int]  # keys: (row, token) of fresh rows' prompts
    done: list[tuple[int, int]]  # (row, its output tokens counted) once applied


class TokenCounts:
    """The rows of the requests staged so far, until `release` (a finished request's row is taken again)."""

    def __init__(self) -> None:
        self.slots: dict[str | int, int] = {}
        self.counted: list[int | None] = []  # per row: output tokens in it (None: not applied yet, or free)
        self.owners: list[Sequence[int] | None] = []  # per row: the prompt (the very list) of the request it counts
        self.free: list[int] = []
        self.output: torch.Tensor | None = None  # [rows, V + 1] float32: tokens past V in the last column
        self.prompt: torch.Tensor | None = None  # [rows, V + 1] bool

    def release(self, key: str | int) -> None:
        """A request that ended: its row is free (cleared when it is taken again)."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.counted[slot], self.owners[slot] = None, None
            self.free.append(slot)

    def stage(self, requests: list[CountRequest], vocab: int, device: torch.device, batch: HostBatch) \
            -> StagedCounts:
        """Each request's row (taken where it has none) and the tokens that bring it up to date, staged in batch;
        the rows are sized for V = vocab on device (rows of another size or device are dropped first)."""
        self._fit(vocab, device, requests)
        slots, fresh, done = [], [], []
        counted: tuple[list[int], list[int]] = ([], [])
        prompted: tuple[list[int], list[int]] = ([], [])
        for r in requests:
            slot = self._slot(r.key)
            since = self.counted[slot]
            if since is None or self.owners[slot] is not r.prompt or since > len(r.output):  # filled from nothing
                since = 0
                self.counted[slot], self.owners[slot] = None, r.prompt  # untrusted until this update runs
                fresh.append(slot)
                if r.with_prompt:
                    prompted[0].extend([slot] * len(r.prompt))
                    prompted[1].extend(r.prompt)
            new = r.output[since:]
            counted[0].extend([slot] * len(new))
            counted[1].extend(new)
            slots.append(slot)
            done.append((slot, len(r.output)))
        return StagedCounts(slots, batch.ints(fresh), (batch.ints(counted[0]), batch.ints(counted[1])),
                            (batch.ints(prompted[0]), batch.ints(prompted[1])), done)

    def apply(self, staged: StagedCounts, sent: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a staged update (`sent`: the step's batch on the device): fresh rows cleared and filled, the new
        tokens counted. Returns (output counts, prompt marks), every row [rows, V + 1]. An update that fails
        forgets its rows (filled from nothing next time) and raises."""
        assert self.output is not None and self.prompt is not None
        try:
            fresh, dev, vocab = sent[staged.fresh], self.output.device, self.output.shape[1] - 1
            if fresh.numel():
                self.output.index_fill_(0, fresh, 0.0)
                self.prompt.index_fill_(0, fresh, False)
            rows, tokens = (sent[key] for key in staged.counted)
            if rows.numel():
                self.output.index_put_((rows, tokens.clamp(max=vocab)), torch.ones((), device=dev), accumulate=True)
            rows, tokens = (sent[key] for key in staged.prompted)
            if rows.numel():
                self.prompt.index_put_((rows, tokens.clamp(max=vocab)), torch.ones((), device=dev, dtype=torch.bool))
        except Exception:  # what ran of it cannot be told: its rows are filled from nothing when staged next
            for slot, _ in staged.done:
                self.counted[slot] = None
            raise
        for slot, count in staged.done:
            self.counted[slot] = count
        return self.output, self.prompt

    def _slot(self, key: str | int) -> int:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.free.pop()
            self.slots[key] = slot
        return slot

    def _fit(self, vocab: int, device: torch.device, requests: list[CountRequest]) -> None:
        """Rows of V + 1 on device, one free for each request that holds none (grown by doubling, rows kept);
        rows of another size or device are dropped first."""
        if self.output is not None and (self.output.shape[1] != vocab + 1 or self.output.device != device):
            self.slots, self.counted, self.owners, self.free, self.output, self.prompt = {}, [], [], [], None, None
        wanted = sum(r.key not in self.slots for r in requests)
        if len(self.free) >= wanted:
            return
        have = len(self.counted)
        size = max(have + wanted - len(self.free), 2 * have, 8)
        output = torch.zeros(size, vocab + 1, device=device)
        prompt = torch.zeros(size, vocab + 1, device=device, dtype=torch.bool)
        if self.output is not None:
            output[:have] = self.output
            prompt[:have] = self.prompt
        self.output, self.prompt = output, prompt
        self.counted += [None] * (size - have)
        self.owners += [None] * (size - have)
        self.free += range(size - 1, have - 1, -1)
