"""Fixed-size KV cache blocks: a free list and per-request block tables."""
from __future__ import annotations

from collections import deque

from smartspec.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, req: Request, num_tokens: int) -> bool:
        """Whether the request's cache can grow to num_tokens tokens with the blocks that are free now."""
        return self.blocks_for(num_tokens) - len(req.block_table) <= len(self._free)

    def allocate(self, req: Request, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need > len(self._free):
            raise RuntimeError(f"{need} KV blocks needed, {len(self._free)} free")
        for _ in range(need):
            req.block_table.append(self._free.popleft())

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep the cache for the first num_tokens tokens; later tokens' slots are simply overwritten, and
        whole blocks past the end go back to the free list. Rejected draft tokens cost O(blocks freed)."""
        keep = self.blocks_for(num_tokens)
        while len(req.block_table) > keep:
            self._free.append(req.block_table.pop())
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)

    def free(self, req: Request) -> None:
        self._free.extend(reversed(req.block_table))
        req.block_table.clear()
        req.num_computed_tokens = 0

    def slot(self, req: Request, position: int) -> int:
        return req.block_table[position // self.block_size] * self.block_size + position % self.block_size
