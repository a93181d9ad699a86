"""Continuous batching: which requests run in the next step, and how many of their tokens."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from smartspec.runtime.block_manager import BlockManager
from smartspec.types.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens from request.num_computed_tokens on that run in this step
    # this chunk reaches the request's last token, so the step yields its next token (fixed when scheduled: the
    # commit changes the request's counters)
    completes: bool = False

    def __post_init__(self) -> None:
        self.completes = self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


def split_batch(batch: list[ScheduledRequest]) -> tuple[list[Request], list[ScheduledRequest]]:
    """(decoding requests, prefill chunks): a request decodes when its one scheduled token is its last, and only
    those can carry drafts; every other chunk is prefill, which the policy prices as the rest of the step."""
    decoding, prefill = [], []
    for s in batch:
        if s.completes and s.num_tokens == 1:
            decoding.append(s.request)
        else:
            prefill.append(s)
    return decoding, prefill


class Scheduler:
    """Running requests go first (oldest first); waiting requests are admitted while the token budget, the
    sequence limit and free KV blocks allow. When blocks run out, the youngest running request is preempted:
    its blocks are freed and it goes back to the front of the queue, to be recomputed, never dropped."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted below to make room for an older request (its
                continue  # status, not a look through the running list: that is a pass per request, quadratic)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:  # nothing due (its next token is not known yet)
                continue
            while not self.blocks.can_hold(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.blocks.allocate(req, req.num_computed_tokens + n)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.block_table and req.prompt_logprobs is None:  # prompt logprobs need every position's row
                self.blocks.match_prefix(req, req.num_tokens - 1)  # the last token is computed: it gives logits
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.can_hold(req, req.num_computed_tokens + n):
                self.blocks.free(req)  # the matched blocks go back (still cached) while it waits
                break
            self.waiting.popleft()
            self.blocks.allocate(req, req.num_computed_tokens + n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        return batch
