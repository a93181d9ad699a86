"""Fixed-size KV cache blocks: a free pool, per-request block tables and, with prefix caching, full blocks shared
between requests by the tokens they hold.

Prefix caching: a full block whose KV was computed is registered under a chain hash of its tokens and of every
token before it, so a later request whose prompt starts with the same tokens reuses the block (a reference count
keeps it while any request holds it). A released block keeps its contents and registration while it waits in the
free pool, least recently released first out: it is evicted only when the pool hands it out again. A request
never writes into a block it did not allocate for itself (it reuses full blocks only, and computes from the first
position after them), and the kernels are batch-invariant, so reused KV is bitwise what recomputing would give."""
from __future__ import annotations

from collections import OrderedDict

from smartspec.types.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest released first
        self._refs = [0] * num_blocks
        self._cached: dict[int, int] = {}  # chain hash -> block holding those tokens' KV
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (chain hash, its tokens), once registered
        # request id -> (its leading full blocks walked, the chain hash after them, the walked blocks whose tokens
        # another block held: (index, chain, tokens)): each step walks only the blocks after them, not the whole
        # table again (at long contexts, hundreds of blocks per request per step), and looks again only at those
        # twins, and only once a registered block was evicted since it last looked (the twin's holder may be gone).
        # A block the request holds stays registered (only the free pool evicts), so this registers what walking
        # the whole table would. Dropped when the table shrinks below it or is freed.
        self._walked: dict[str, tuple[int, int, tuple, int]] = {}
        self._evictions = 0  # registered blocks evicted (or forgotten), in all: when twins may be registered
        self.num_prefix_queries = 0  # prompt tokens looked up in the cache, and found (vLLM's counters)
        self.num_prefix_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones among them: they are evicted when handed out)."""
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
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            req.block_table.append(block)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep the cache for the first num_tokens tokens; later tokens' slots are simply overwritten, and
        whole blocks past the end go back to the free pool. Rejected draft tokens cost O(blocks freed)."""
        keep = self.blocks_for(num_tokens)
        while len(req.block_table) > keep:
            self._release(req.block_table.pop())
        if self._walked.get(req.request_id, (0,))[0] > len(req.block_table):
            del self._walked[req.request_id]
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)

    def free(self, req: Request) -> None:
        """Give back all of a request's blocks; with prefix caching its computed full blocks stay findable."""
        self.register(req)
        self._walked.pop(req.request_id, None)
        for block in reversed(req.block_table):  # a prompt's last blocks are evicted before its first
            self._release(block)
        req.block_table.clear()
        req.num_computed_tokens = 0

    def slot(self, req: Request, position: int) -> int:
        return req.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- prefix caching -------------------------------------------------------------------------------------
    def match_prefix(self, req: Request, max_tokens: int) -> int:
        """A request holding no blocks yet takes the cached full blocks its first max_tokens tokens start with;
        its computed tokens start after them. Returns the tokens reused."""
        if not self.enable_prefix_caching or req.block_table:
            return 0
        self.num_prefix_queries += max_tokens // self.block_size * self.block_size
        for block in self._cached_prefix(req.token_ids, max_tokens):
            self._free.pop(block, None)
            self._refs[block] += 1
            req.block_table.append(block)
        matched = len(req.block_table) * self.block_size
        req.num_computed_tokens = matched
        self.num_prefix_hits += matched
        return matched

    def cached_tokens(self, token_ids: list[int], max_tokens: int) -> int:
        """How many of the first max_tokens tokens match_prefix would take from the cache now: a look, which takes,
        counts and evicts nothing."""
        if not self.enable_prefix_caching:
            return 0
        return sum(1 for _ in self._cached_prefix(token_ids, max_tokens)) * self.block_size

    def _cached_prefix(self, token_ids: list[int], max_tokens: int):
        """The cached blocks holding the full blocks the first max_tokens tokens start with, in order (a block is
        found by the chain hash of its tokens and all before them, and its tokens compared)."""
        chain, size = 0, self.block_size
        for i in range(max_tokens // size):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            chain = hash((chain, tokens))
            block = self._cached.get(chain)
            if block is None or self._key[block][1] != tokens:
                return
            yield block

    def register(self, req: Request, num_tokens: int | None = None) -> None:
        """Make the request's full blocks among its first num_tokens computed tokens (default: all of them)
        findable by later requests. Only tokens that will not be rewritten may be registered."""
        if not self.enable_prefix_caching:
            return
        limit = min(req.num_computed_tokens, len(req.token_ids), num_tokens if num_tokens is not None else 1 << 62)
        full = min(limit // self.block_size, len(req.block_table))
        walked, chain, twins, looked_at = self._walked.get(req.request_id, (0, 0, (), 0))
        if full <= walked and (not twins or looked_at == self._evictions):
            return
        if twins and looked_at != self._evictions and not all(twin[1] in self._cached for twin in twins):
            for i, twin_chain, tokens in twins:  # registered now if the block holding their tokens was evicted
                if twin_chain not in self._cached:
                    self._cached[twin_chain] = req.block_table[i]
                    self._key[req.block_table[i]] = (twin_chain, tokens)
            twins = tuple(t for t in twins if req.block_table[t[0]] not in self._key)
        for i in range(walked, full):
            block = req.block_table[i]
            if block in self._key:  # registered already (by this request, or matched): its chain is known
                chain = self._key[block][0]
                continue
            tokens = tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size])
            chain = hash((chain, tokens))
            if chain not in self._cached:
                self._cached[chain] = block
                self._key[block] = (chain, tokens)
            else:  # another block holds the same tokens: this one is registered if that one is evicted
                twins += ((i, chain, tokens),)
        self._walked[req.request_id] = (max(walked, full), chain, twins, self._evictions)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (their contents stay, unfindable): the next requests start cold."""
        self._cached.clear()
        self._key.clear()
        self._walked.clear()
        self._evictions += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None

    def _evict(self, block: int) -> None:
        key = self._key.pop(block, None)
        if key is not None:
            del self._cached[key[0]]
            self._evictions += 1
