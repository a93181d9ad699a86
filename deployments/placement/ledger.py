"""What a replica keeps for the goodput router (router.py, latency.py): the prefix keys of the prompts it served
lately, how many characters a prompt token has here, and a request's mean time from acceptance to its end; read as
the `RoutingStats` Serve hands the router."""
from __future__ import annotations

import time

from deployments.placement.latency import CHUNK_CHARS, ServedPrefixes, prefix_keys
from deployments.wire import RoutingStats
from smartspec.types.snapshot import LoadCosts

REQUEST_S_WEIGHT = 0.1  # a finished request's weight in the moving average of request times


class RoutingLedger:
    def __init__(self, capacity: int = 4096) -> None:
        self.served = ServedPrefixes(capacity)
        self.prompt_chars = self.prompt_tokens = 0
        self.request_s: float | None = None  # a request's time from acceptance to its end, moving average

    def accepted(self, prefix_text: str, num_prompt_tokens: int) -> None:
        """A request was taken: its prompt's prefix keys and size."""
        self.served.add(prefix_keys(prefix_text))
        self.prompt_chars += len(prefix_text)
        self.prompt_tokens += num_prompt_tokens

    def finished(self, seconds: float) -> None:
        """A request ended `seconds` after it was taken."""
        self.request_s = seconds if self.request_s is None else \
            (1 - REQUEST_S_WEIGHT) * self.request_s + REQUEST_S_WEIGHT * seconds

    def stats(self, ongoing: int, max_num_seqs: int, costs: LoadCosts, kv_capacity_tokens: int) -> RoutingStats:
        """The router's view of this replica now. The prefix memory is sized to about as many keys as the KV cache
        holds tokens, once the characters per token are known."""
        chars_per_token = self.prompt_chars / self.prompt_tokens if self.prompt_tokens else None
        if chars_per_token:
            self.served.capacity = max(64, int(kv_capacity_tokens * chars_per_token / CHUNK_CHARS))
        return RoutingStats(time.time(), ongoing, max_num_seqs, costs.request_speed, costs.prefill_s_per_token,
                            chars_per_token, self.request_s, self.served.snapshot())
