"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's suffix."""
from __future__ import annotations

from array import array

from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.request import Request
from smartspec.types.tree import MAX_TREE_NODES, TokenTree, best_first, count_trie

_WIDTH = array("I").itemsize  # bytes a token takes in the searched context


def lookup(tokens: list[int], k: int, n_max: int, n_min: int, data: bytes | None = None) -> list[int]:
    """Longest suffix first (n_max down to n_min); the most recent earlier match wins."""
    found = lookup_all(tokens, k, n_max, n_min, max_matches=1, data=data)
    return found[0] if found else []


class ContextBytes:
    """Each running request's context as the bytes lookup_all searches, grown by the tokens committed since the
    last step rather than packed again every step (a request's tokens are only ever appended to)."""

    def __init__(self) -> None:
        self._packed: dict[str, array] = {}

    def of(self, req: Request) -> bytes:
        tokens, packed = req.token_ids, self._packed.get(req.request_id)
        if packed is None or len(packed) > len(tokens) or (len(packed) and packed[-1] != tokens[len(packed) - 1]):
            packed = self._packed[req.request_id] = array("I", tokens)
        elif len(packed) < len(tokens):
            packed.extend(tokens[len(packed):])
        return packed.tobytes()

    def release(self, request_id: str) -> None:
        self._packed.pop(request_id, None)


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.contexts = ContextBytes()

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        tokens = [lookup(r.token_ids, k, self.n_max, self.n_min, self.contexts.of(r)) if k > 0 else []
                  for r, k in zip(requests, ks)]
        return Proposal(tokens, [None] * len(requests))

    def release(self, request_id: str) -> None:
        self.contexts.release(request_id)


def lookup_all(tokens: list[int], depth: int, n_max: int, n_min: int, max_matches: int = 16,
               data: bytes | None = None) -> list[list[int]]:
    """The continuations of every earlier occurrence of the longest suffix that occurs (most recent first). data:
    the tokens packed already (ContextBytes).

    Searched in the context's bytes (4 per token) by bytes.rfind, in C: a scan in Python cost 20 us a request a step
    at 150 tokens of context and grows with it (the tree proposer's whole stage at 256 requests). A hit that does
    not start on a token's first byte is no occurrence; the search goes on before it."""
    total = len(tokens)
    if total < 2:
        return []
    data, width = array("I", tokens).tobytes() if data is None else data, _WIDTH
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = data[(total - n) * width:]
        found, end = [], (total - 1) * width  # an occurrence ends before the last token (the suffix's own is last)
        while len(found) < max_matches and (at := data.rfind(suffix, 0, end)) >= 0:
            if at % width == 0:
                start = at // width
                found.append(tokens[start + n:start + n + depth])
            end = at + len(suffix) - 1  # only occurrences that start before this one
        if found:
            return found
    return []


class NgramTreeProposer(Proposer):
    """Prompt lookup as a tree: the continuations of all earlier occurrences of the context's suffix, merged where
    they agree. A node's confidence is the share of its parent's matches that continue with its token."""
    method = "ngram"

    def __init__(self, max_depth: int, branching: int, n_max: int = 4, n_min: int = 1) -> None:
        self.max_depth, self.branching = max_depth, branching
        self.n_max, self.n_min = n_max, n_min
        self.contexts = ContextBytes()

    def tree(self, tokens: list[int], budget: int, data: bytes | None = None) -> TokenTree:
        follows = lookup_all(tokens, self.max_depth, self.n_max, self.n_min, data=data)
        node_tokens, parents, counts = count_trie(follows, self.branching)
        root_count = max(1, len(follows))
        conf = [counts[i] / (counts[p] if p >= 0 else root_count) for i, p in enumerate(parents)]
        return best_first(node_tokens, parents, [c / root_count for c in counts], conf, limit=budget,
                          sibling_order=False)  # fixed tokens: any subset of siblings verifies exactly

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        trees = [self.tree(r.token_ids, min(k, MAX_TREE_NODES), self.contexts.of(r)) if k > 0
                 else TokenTree([], [], []) for r, k in zip(requests, ks)]
        return Proposal([t.tokens for t in trees], [None] * len(requests), trees)

    def release(self, request_id: str) -> None:
        self.contexts.release(request_id)
