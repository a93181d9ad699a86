"""Goodput for token trees.

A tree's expected accepted length is the sum over its nodes of P(node on the accepted path), and

    P(node on path) = P(parent on path) * P(node accepted | parent on path) = prod over the path of c(conf)

where conf is the drafter's confidence in a node (its draft probability; prompt lookup: its share of matches) and c
is a calibration learned online from verified trees (`NodeCalibration`). Each node adds one batched token to the
verify forward, so the step-cost model prices it. Before drafting, the policy picks each request's node budget from
the values of its last tree (`TreeGains`); after drafting, it keeps the nodes of highest value across the batch
while goodput rises (`prune_trees`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from smartspec.types.tree import TokenTree, capped_scores


class NodeCalibration:
    """P(a node is on the accepted path | its parent is), by confidence bin: decayed counts, shrunk toward the
    confidence itself (a calibrated drafter needs no correction)."""

    def __init__(self, bins: int = 10, strength: float = 2.0, decay: float = 0.999) -> None:
        self.bins, self.strength, self.decay = bins, strength, decay
        self.accepted = np.zeros(bins)  # this engine's evidence (exported)
        self.total = np.zeros(bins)
        self.shared_accepted = np.zeros(bins)  # other replicas', as last received
        self.shared_total = np.zeros(bins)

    def _bin(self, conf) -> np.ndarray:
        return np.minimum((np.asarray(conf, dtype=np.float64) * self.bins).astype(np.int64), self.bins - 1)

    def probability(self, conf) -> np.ndarray:
        b = self._bin(conf)
        acc = self.accepted[b] + self.shared_accepted[b]
        tot = self.total[b] + self.shared_total[b]
        return (acc + self.strength * np.asarray(conf, dtype=np.float64)) / (tot + self.strength)

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        """Every node whose parent was on the accepted path was tried; it succeeded if it is on the path too."""
        on_path = set(path)
        tried = [i for i, p in enumerate(tree.parents) if p < 0 or p in on_path]
        if not tried:
            return
        self.accepted *= self.decay
        self.total *= self.decay
        bins = self._bin([tree.confidences[i] for i in tried])
        np.add.at(self.total, bins, 1.0)
        np.add.at(self.accepted, bins, [1.0 if i in on_path else 0.0 for i in tried])

    def export_state(self) -> dict:
        return {"accepted": self.accepted.tolist(), "total": self.total.tolist()}

    def import_state(self, state: dict) -> None:
        if len(state.get("total", ())) == self.bins:
            self.shared_accepted = np.asarray(state["accepted"], dtype=np.float64)
            self.shared_total = np.asarray(state["total"], dtype=np.float64)


def node_values(tree: TokenTree, calibration: NodeCalibration) -> np.ndarray:
    """P(node on the accepted path) per node; capped along siblings when their order matters (sampled drafts), so
    keeping the nodes of highest value keeps a valid tree."""
    c = calibration.probability(tree.confidences) if len(tree) else np.zeros(0)
    values: list[float] = []
    for i, p in enumerate(tree.parents):
        values.append(float(c[i]) * (values[p] if p >= 0 else 1.0))
    return np.asarray(capped_scores(tree.parents, values, sibling_order=bool(tree.child_probs)))


class TreeGains:
    """Per request, the expected tokens its n-th best node adds, from its last tree's node values (ranks past that
    tree's size continue its last ratio); new requests use an average over recent trees of all requests."""

    def __init__(self, k_max: int, prior_alpha: float, smoothing: float = 0.1) -> None:
        self.k_max = k_max
        self.smoothing = smoothing
        self.prior = prior_alpha ** np.arange(1, k_max + 1, dtype=np.float64)
        self.requests: dict[str, np.ndarray] = {}

    def curve(self, request_id: str) -> np.ndarray:
        return self.requests.get(request_id, self.prior)

    def update(self, request_id: str, values: np.ndarray) -> None:
        v = np.sort(values)[::-1][: self.k_max]
        if len(v) == 0:  # nothing to propose (prompt lookup found no match): expect less next time
            self.requests[request_id] = self.curve(request_id) * 0.5
            return
        curve = np.empty(self.k_max)
        curve[: len(v)] = v
        ratio = min(1.0, v[-1] / v[-2]) if len(v) >= 2 and v[-2] > 0 else 0.5
        curve[len(v):] = v[-1] * ratio ** np.arange(1, self.k_max - len(v) + 1)
        self.requests[request_id] = curve
        self.prior = (1 - self.smoothing) * self.prior + self.smoothing * curve

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def prune_trees(trees: list[TokenTree], values: list[np.ndarray], cost: Callable, base_tokens: int,
                base_context: int, draft_s: float) -> tuple[list[TokenTree], float]:
    """Keep the nodes of highest value across the batch while goodput, (requests + sum of kept values) / (draft time
    spent + predicted verify time), rises. Returns the trees and the step time expected for them (the draft time
    as measured plus the predicted rest)."""
    b = len(trees)
    flat = [(-float(v), i, n) for i, vals in enumerate(values) for n, v in enumerate(vals)]
    flat.sort()
    gains = np.array([-v for v, _, _ in flat])
    m = np.arange(0, len(flat) + 1)
    t = draft_s + cost(base_tokens + m, base_context + m)
    gp = (b + np.concatenate([[0.0], np.cumsum(gains)])) / t
    best = int(np.argmax(gp))
    keep: list[list[int]] = [[] for _ in trees]
    for _, i, n in flat[:best]:
        keep[i].append(n)
    out = [tree.select(sorted(k)) if len(k) < len(tree) else tree for tree, k in zip(trees, keep)]
    return out, float(t[best])
