"""Token trees: several candidate continuations of one request, verified together in one target forward.

The root is the request's last committed token (it is fed first); nodes 0..n-1 follow it, each with its parent
(-1: the root). Parents come before children and siblings in the order they were drawn; a selection of nodes keeps
a node's parent and its earlier siblings, which sampled acceptance needs (a sibling was drawn from the draft
distribution without the ones before it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The root and the nodes share one 64-bit ancestor mask per token (the attention kernel's tree mask).
MAX_TREE_TOKENS = 64
MAX_TREE_NODES = MAX_TREE_TOKENS - 1


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]  # parents[i] < i; -1 is the root
    # per node, the drafter's confidence in it: the probability it gave the token (prompt lookup: the share of
    # matches that continue this way). What the policy calibrates into acceptance probabilities.
    confidences: list[float]
    # sampled requests of a draft model: the draft distribution [V] each expanded node's children were drawn
    # from, by node (-1: the root). Absent for greedy requests and model-free drafts (deterministic tokens).
    child_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.confidences)):
            raise ValueError("a token tree needs one parent and one confidence per token")
        if len(self.tokens) > MAX_TREE_NODES:
            raise ValueError(f"a token tree holds at most {MAX_TREE_NODES} nodes, got {len(self.tokens)}")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"tree parents must precede their children: {self.parents}")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], confidences: list[float] | None = None) -> TokenTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), confidences or [1.0] * len(tokens))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node (the root's children: 1), i.e. its offset from the root's position."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> tuple[int, ...]:
        """The node's children (-1: the root's) in draw order."""
        return self._children.get(node, ())

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` (-1: the root) that holds `token`, if one does (siblings' tokens are distinct)."""
        return self._child_by_token.get((node, token))

    # A tree is built whole and never grown: its indexes are made at the first walk down it and kept (verifying
    # and committing walk each tree several times a step: a lookup a level, not a scan of every parent).
    @cached_property
    def _children(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return {p: tuple(nodes) for p, nodes in out.items()}

    @cached_property
    def _child_by_token(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for i, (p, tok) in enumerate(zip(self.parents, self.tokens)):
            out.setdefault((p, tok), i)  # the first of equal siblings, as a scan in draw order finds
        return out

    def ancestor_masks(self) -> list[int]:
        """For the root and every node, as signed 64-bit ints: bit 0 is the root, bit i + 1 is node i; a token sees
        itself and its ancestors, never a sibling or a cousin."""
        masks = [1]
        for i, p in enumerate(self.parents):
            masks.append(masks[p + 1] | (1 << (i + 1)))
        return [signed64(m) for m in masks]

    def paths(self) -> list[list[int]]:
        """The tokens from the root down to each node, node included (what the target has seen after it)."""
        out: list[list[int]] = []
        for tok, p in zip(self.tokens, self.parents):
            out.append((out[p] if p >= 0 else []) + [tok])
        return out

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes a sequence of accepted tokens walks down from the root (siblings' tokens are distinct)."""
        path, node, child = [], -1, self._child_by_token
        for tok in tokens:
            nxt = child.get((node, tok))
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        return path

    def select(self, keep: list[int]) -> TokenTree:
        """The tree of the given nodes (ascending, closed under parents); nodes are renumbered."""
        kept = set(keep)
        if any(self.parents[i] >= 0 and self.parents[i] not in kept for i in keep):
            raise ValueError("a selected node's parent was not selected")
        return _subtree(self.tokens, self.parents, self.confidences, self.child_probs, keep)



def count_trie(sequences, max_children: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Token sequences merged where they agree: node tokens, parents (-1: the root, parents first) and how many
    sequences pass through each node. With max_children, a sequence stops where it would add a node's child beyond
    that many (the first sequences keep theirs)."""
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    num_children: dict[int, int] = {}
    for seq in sequences:
        node = -1
        for tok in seq:
            child = index.get((node, tok))
            if child is None:
                if max_children is not None and num_children.get(node, 0) >= max_children:
                    break
                num_children[node] = num_children.get(node, 0) + 1
                child = index[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                counts.append(0)
            counts[child] += 1
            node = child
    return tokens, parents, counts


def best_first(tokens: list[int], parents: list[int], scores: list[float], confidences: list[float],
               child_probs: dict[int, torch.Tensor] | None = None, limit: int = MAX_TREE_NODES,
               sibling_order: bool = True) -> TokenTree:
    """The `limit` best of some candidate nodes (given parent-first, siblings in draw order) by score, as a tree.
    A node's score is capped by its parent's (and, with sibling_order, its previous sibling's: sampled drafts), so
    what is kept stays closed under them."""
    eff = capped_scores(parents, scores, sibling_order)
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-eff[i], i))[:limit])
    return _subtree(tokens, parents, confidences, child_probs or {}, keep)


def _subtree(tokens, parents, confidences, child_probs, keep: list[int]) -> TokenTree:
    """The nodes `keep` (ascending, closed under parents), renumbered."""
    index = {old: new for new, old in enumerate(keep)}
    return TokenTree([tokens[i] for i in keep], [index.get(parents[i], -1) for i in keep],
                     [confidences[i] for i in keep],
                     {index.get(n, -1): q for n, q in child_probs.items() if n < 0 or n in index})


def signed64(mask: int) -> int:
    """A 64-bit mask as the signed int64 the attention kernel reads."""
    return mask - (1 << 64) if mask >= 1 << 63 else mask


def capped_scores(parents: list[int], scores: list[float], sibling_order: bool = True) -> list[float]:
    """Scores made non-increasing from a parent to its children (and along siblings in draw order)."""
    eff = list(scores)
    last_child: dict[int, int] = {}
    for i, p in enumerate(parents):
        cap = eff[p] if p >= 0 else float("inf")
        if sibling_order and p in last_child:
            cap = min(cap, eff[last_child[p]])
        eff[i] = min(eff[i], cap)
        last_child[p] = i
    return eff
