"""Suffix speculation: the continuations of the context's longest repeated suffix, found in the request's own prompt
and output and in recent finished outputs, merged into a token tree whose node confidences are match counts.

A suffix tree answers one question here: "where has the end of this context occurred before, and what followed it,
how often?" `SuffixIndex` answers it from an index of where each short n-gram ends (memory linear in the tokens
held; a trie of every substring would hold depth x tokens nodes): the anchor n-gram's most recent occurrences are
extended backwards to their full match length, and the occurrences of the longest match, with what followed them,
are the subtree of the suffix tree under the match. Each node's confidence is the share of its parent's occurrences
that continue with its token, discounted for a short match (one matched token says less about what comes next than
ten do); the policy calibrates confidences into acceptance probabilities online (`NodeCalibration`).

Model-free and cheap: the lookups run before k is chosen, so the goodput policy sees the actual candidates
(`lookups`), not a guess from the last step's."""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import NamedTuple

from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.request import Request
from smartspec.types.tree import MAX_TREE_NODES, TokenTree, best_first, count_trie

ANCHORS = (4, 1)  # n-grams indexed: a long anchor finds long matches among few occurrences; a short one, any match
MAX_OCCURRENCES = 64  # most recent occurrences of an anchor extended per lookup
MAX_MATCH = 32  # the longest suffix compared


class Occurrence(NamedTuple):
    length: int  # tokens of the context's suffix matched
    seq: list[int]  # the sequence it occurred in
    start: int  # where its continuation starts in seq
    key: object  # the sequence's key in its index


class SuffixIndex:
    """Sequences of tokens, with where each anchor n-gram ends in them."""

    def __init__(self) -> None:
        self.seqs: dict[object, list[int]] = {}
        self.ends: dict[tuple, list[tuple[object, int]]] = defaultdict(list)  # n-gram -> (key, end + 1)

    def num_tokens(self, key) -> int:
        return len(self.seqs.get(key, ()))

    def extend(self, key, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(key, [])
        for tok in tokens:
            seq.append(tok)
            n = len(seq)
            for a in ANCHORS:
                if n >= a:
                    self.ends[tuple(seq[n - a:])].append((key, n))

    def remove(self, key) -> None:
        seq = self.seqs.pop(key, None)
        if seq is None:
            return
        for a in ANCHORS:
            for n in range(a, len(seq) + 1):
                gram = tuple(seq[n - a:n])
                kept = [e for e in self.ends.get(gram, ()) if e[0] != key]
                if kept:
                    self.ends[gram] = kept
                else:
                    self.ends.pop(gram, None)

    def occurrences(self, context: list[int]) -> list[Occurrence]:
        """Earlier occurrences of the context's end that something followed, with their match lengths: those of the
        longest anchor that has any (each anchor's most recent MAX_OCCURRENCES)."""
        total = len(context)
        for a in ANCHORS:
            if total < a:
                continue
            found = []
            for key, end in reversed(self.ends.get(tuple(context[total - a:]), ())):
                seq = self.seqs[key]
                if end >= len(seq):  # nothing followed it yet (the context's own end)
                    continue
                length = a
                limit = min(MAX_MATCH, end, total)
                while length < limit and seq[end - length - 1] == context[total - length - 1]:
                    length += 1
                found.append(Occurrence(length, seq, end, key))
                if len(found) == MAX_OCCURRENCES:
                    break
            if found:
                return found
        return []


def continuation_tree(occurrences: list[Occurrence], depth: int, branching: int, budget: int) -> TokenTree:
    """The continuations of the occurrences, merged into a trie (at most `branching` children a node, the most
    frequent), cut to the `budget` nodes of highest path probability."""
    if not occurrences or budget <= 0:
        return TokenTree([], [], [])
    match = min(o.length for o in occurrences)
    tokens, parents, counts = count_trie(o.seq[o.start:o.start + depth] for o in occurrences)
    discount = match / (match + 1.0)
    conf = [discount * counts[i] / (counts[p] if p >= 0 else len(occurrences)) for i, p in enumerate(parents)]
    scores = path_products(conf, parents)
    # at most `branching` children a node: the most frequent (a dropped child's subtree goes with it)
    allowed = [True] * len(tokens)
    by_parent: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(parents):
        by_parent[p].append(i)
    for kids in by_parent.values():
        for i in sorted(kids, key=lambda i: (-counts[i], i))[branching:]:
            allowed[i] = False
    for i, p in enumerate(parents):
        if p >= 0 and not allowed[p]:
            allowed[i] = False
    scores = [s if ok else -1.0 for s, ok in zip(scores, allowed)]
    limit = min(budget, sum(allowed), MAX_TREE_NODES)
    # fixed tokens: any subset of siblings verifies exactly, so siblings need no order
    return best_first(tokens, parents, scores, conf, limit=limit, sibling_order=False)


def best_continuation(occurrences: list[Occurrence], depth: int, branching: int, budget: int) -> TokenTree:
    """Of the trees under each match length found (a longer match: fewer occurrences that agree more), the one whose
    nodes add the most expected tokens by their confidences."""
    best, best_value = TokenTree([], [], []), 0.0
    for length in sorted({o.length for o in occurrences}, reverse=True)[:4]:
        tree = continuation_tree([o for o in occurrences if o.length >= length], depth, branching, budget)
        value = sum(path_probabilities(tree))
        if value > best_value:
            best, best_value = tree, value
    return best


def path_products(confidences: list[float], parents: list[int]) -> list[float]:
    """Per node, the product of the confidences along its path from the root."""
    out: list[float] = []
    for c, p in zip(confidences, parents):
        out.append(c * (out[p] if p >= 0 else 1.0))
    return out


def path_probabilities(tree: TokenTree) -> list[float]:
    return path_products(tree.confidences, tree.parents)


def crop(tree: TokenTree, k: int) -> TokenTree:
    """The k nodes of highest path probability (closed under parents: a child's is at most its parent's)."""
    if k >= len(tree):
        return tree
    probs = path_probabilities(tree)
    return tree.select(sorted(sorted(range(len(tree)), key=lambda i: (-probs[i], i))[:k]))


class FinishedOutputs:
    """The outputs of recently finished requests, at most max_tokens of them: the least recently used (finished or
    matched) go first."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self.order: OrderedDict[object, int] = OrderedDict()  # key -> tokens
        self.num_tokens = 0
        self._next = 0

    def add(self, tokens: list[int]) -> None:
        if not tokens or self.max_tokens <= 0:
            return
        tokens = tokens[-self.max_tokens:]
        key, self._next = self._next, self._next + 1
        self.index.extend(key, tokens)
        self.order[key] = len(tokens)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            old, n = self.order.popitem(last=False)
            self.index.remove(old)
            self.num_tokens -= n

    def touch(self, keys) -> None:
        for key in keys:
            if key in self.order:
                self.order.move_to_end(key)


class SuffixProposer(Proposer):
    """Per request an index of its prompt and output; one index of recent finished outputs shared by all."""
    method = "suffix"

    def __init__(self, max_depth: int, branching: int = 1, cache_tokens: int = 65536) -> None:
        self.max_depth, self.branching = max_depth, branching
        self.local: dict[str, SuffixIndex] = {}
        self.finished = FinishedOutputs(cache_tokens)
        self._looked_up: dict[str, tuple[int, TokenTree]] = {}

    def lookups(self, requests: list[Request], budget: int) -> list[TokenTree]:
        """Per request, its best continuation tree of at most `budget` nodes (empty where nothing matches); kept
        for this step's propose."""
        trees = [self._tree(r, budget) for r in requests]
        self._looked_up = {r.request_id: (r.num_tokens, t) for r, t in zip(requests, trees)}
        return trees

    def _tree(self, req: Request, budget: int) -> TokenTree:
        return self._tree_of(req.request_id, req.token_ids, budget)

    def _tree_of(self, key: str, context: list[int], budget: int) -> TokenTree:
        """The lookup of a request whose tokens so far are `context` (they only grow from call to call)."""
        local = self.local.get(key)
        if local is None:
            local = self.local[key] = SuffixIndex()
        seen = local.num_tokens(0)
        if seen < len(context):
            local.extend(0, context[seen:])
        shared = self.finished.index.occurrences(context)
        found = local.occurrences(context) + shared
        if not found:
            return TokenTree([], [], [])
        self.finished.touch({o.key for o in shared})
        return best_continuation(found, self.max_depth, self.branching, min(budget, MAX_TREE_NODES))

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        """The k best nodes of each request's tree (the one lookups found this step, if it did)."""
        looked_up, self._looked_up = self._looked_up, {}
        trees = []
        for r, k in zip(requests, ks):
            num_tokens, tree = looked_up.get(r.request_id, (None, None))
            if k <= 0:
                tree = TokenTree([], [], [])
            elif num_tokens != r.num_tokens or tree is None:
                tree = self._tree(r, k)
            trees.append(crop(tree, k))
        return Proposal([t.tokens for t in trees], [None] * len(requests), trees)

    def finish(self, request: Request) -> None:
        self.finished.add(request.output_token_ids)

    def replayed_lookups(self, answers: list[tuple[list[int], list[int]]], budget: int) -> list[tuple[TokenTree,
                                                                                                       list[int]]]:
        """Along each known answer (prompt, output), at every position, the tree a lookup would have offered and the
        path the answer takes through it: what greedy verification would have accepted, with no forward run. A
        fresh proposer of these settings reads the answers in turn, each finished into its cache as serving does;
        this one is left as it was."""
        fresh = SuffixProposer(self.max_depth, self.branching, self.finished.max_tokens)
        depth = min(self.max_depth, budget)
        replayed = []
        for n, (prompt, output) in enumerate(answers):
            key = f"__replay-{n}"
            for j in range(len(output) - depth + 1):  # a tree's deepest node has a known token to meet
                tree = fresh._tree_of(key, list(prompt) + list(output[:j]), budget)
                if len(tree):
                    replayed.append((tree, tree.follow(list(output[j:]))))
            fresh.local.pop(key, None)
            fresh.finished.add(list(output))
        return replayed

    def release(self, request_id: str) -> None:
        self.local.pop(request_id, None)
