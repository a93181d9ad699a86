"""Acceptance estimates: per request, shrunk toward a prior that is learned from all requests.

A step that proposed k tokens of which a were accepted gives a accepted tokens and one rejection if a < k: the
estimate accepted / (accepted + rejections) is then the probability that a proposed token is accepted given its
predecessors were (the alpha of the goodput model). Evidence decays with time, so a request that stops
proposing (k = 0) drifts back to the prior.

How far a request's estimate is pulled toward the prior (the prior's strength, in pseudo-outcomes) is learned from
finished requests, as in empirical Bayes: when requests differ little beyond what their counts' noise explains, a
few early rejections should not talk one request out of drafting; when they differ a lot, each request's own
evidence decides.

Until enough requests have finished to learn it, the strength is unknown, and no single guess is right: a weak
prior lets one rejected first draft talk a request out of drafting (prompt lookup often misses on the first tokens
of an answer, then copies the prompt for the rest), a strong one keeps a request that never gets a draft accepted
drafting for many steps. So a cold estimator averages the request's estimate over strengths spread evenly in log
scale across the range, each weighted by how likely it makes the request's own outcomes (a beta-binomial
marginal likelihood): a couple of outcomes leave the strengths almost equally likely and the estimate near the
prior; a run of rejections makes the strong priors unlikely and the estimate follows the request."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from smartspec.policy.request_slots import RequestSlots


def log_gamma(x: np.ndarray) -> np.ndarray:
    """log Gamma(x) for x > 0, elementwise (numpy has none): Gamma(x) = Gamma(x + 6) / (x (x+1) ... (x+5)), and
    Stirling's series for log Gamma(x + 6): within 1e-8 of math.lgamma."""
    x = np.asarray(x, dtype=np.float64)
    z = x + 6.0
    zi = 1.0 / z
    series = zi * (1 / 12 - zi * zi * (1 / 360 - zi * zi / 1260))
    return ((z - 0.5) * np.log(z) - z + 0.5 * math.log(2 * math.pi) + series
            - np.log(x * (x + 1) * (x + 2) * (x + 3) * (x + 4) * (x + 5)))


def _log_gammas_of_numbers(xs: list[float]) -> list[float]:
    """log_gamma's formula for a few numbers in Python floats (numpy's per-call cost is most of a small batch's), their
    logarithms taken by numpy in one call, as log_gamma takes them: numpy's SIMD log and libm's differ in the last
    bit on some CPUs (AVX-512), and a request's estimate must not depend on its batch's size."""
    zs = [x + 6.0 for x in xs]
    logs = np.log(np.array(zs + [x * (x + 1) * (x + 2) * (x + 3) * (x + 4) * (x + 5) for x in xs])).tolist()
    out = []
    for z, log_z, log_p in zip(zs, logs[:len(xs)], logs[len(xs):]):
        zi = 1.0 / z
        series = zi * (1 / 12 - zi * zi * (1 / 360 - zi * zi / 1260))
        out.append((z - 0.5) * log_z - z + 0.5 * math.log(2 * math.pi) + series - log_p)
    return out


def _strength_averaged_of_a_request(per_strength: tuple, a: float, r: float) -> float:
    """_strength_averaged for one request's outcomes, in Python floats but for numpy's log and exp (the batch's
    own: see _log_gammas_of_numbers); per_strength: (s, a0, r0, log Gamma(a0), log Gamma(r0), log Gamma(s)) per
    strength."""
    lg = _log_gammas_of_numbers([v for s, a0, r0, *_ in per_strength for v in (a + a0, r + r0, a + r + s)])
    logs = [lg[3 * i] + lg[3 * i + 1] - lg[3 * i + 2] - log_a0 - log_r0 + log_s
            for i, (s, a0, r0, log_a0, log_r0, log_s) in enumerate(per_strength)]
    top = max(logs)
    weights = np.exp(np.array(logs) - top).tolist()
    return sum(w * (a + t[1]) / (a + r + t[0]) for w, t in zip(weights, per_strength)) / sum(weights)


SCALAR_ROWS = 2  # a batch of at most this many: each estimate in Python floats, not numpy arrays


def _strength_averaged(terms: tuple, a: np.ndarray, r: np.ndarray) -> np.ndarray:
    """AcceptanceEstimator._averaged_over_strengths for requests with outcomes a, r [B], given the prior's terms."""
    s, a0, r0, log_a0, log_r0, log_s = terms
    a, r = a[:, None], r[:, None]
    # the three log-gammas in one call: elementwise, so the same values, at a third of numpy's per-call cost (the
    # policy asks for every batch's estimates every step)
    lg_a, lg_r, lg_n = log_gamma(np.stack(np.broadcast_arrays(a + a0, r + r0, a + r + s)))
    logs = lg_a + lg_r - lg_n - log_a0 - log_r0 + log_s
    weights = np.exp(logs - logs.max(axis=1, keepdims=True))
    return (weights * (a + a0) / (a + r + s)).sum(axis=1) / weights.sum(axis=1)


@dataclass
class Counts:
    accepted: float = 0.0
    rejected: float = 0.0

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor

    def add(self, accepted: float, rejected: float) -> None:
        self.accepted += accepted
        self.rejected += rejected


# a request's columns in the estimator's RequestSlots: accepted and rejected as of step AT (decayed since by
# request_decay ** (clock - at)), and undecayed totals over its whole life
ACCEPTED, REJECTED, AT, TOTAL_ACCEPTED, TOTAL_REJECTED = range(5)


@dataclass(frozen=True)
class EstimatorSettings:
    """How AcceptanceEstimator weighs evidence: the prior's strength (None: learned from finished requests, within
    strength_range, from the last finished_window of them once min_finished with min_outcomes each have finished;
    until then averaged over cold_strengths strengths), how fast a request's and the prior's counts decay, and the
    ceiling of an estimate."""
    prior_strength: float | None = None
    request_decay: float = 0.9
    prior_decay: float = 0.995
    max_alpha: float = 0.99
    strength_range: tuple[float, float] = (4.0, 64.0)
    finished_window: int = 64
    min_finished: int = 8
    min_outcomes: int = 8
    cold_strengths: int = 5


class AcceptanceEstimator:
    def __init__(self, prior_alpha: float = 0.5, settings: EstimatorSettings = EstimatorSettings()) -> None:
        prior_strength, request_decay, prior_decay, max_alpha, strength_range = (
            settings.prior_strength, settings.request_decay, settings.prior_decay, settings.max_alpha,
            settings.strength_range)
        finished_window, min_finished, min_outcomes, cold_strengths = (
            settings.finished_window, settings.min_finished, settings.min_outcomes, settings.cold_strengths)
        self.initial_prior = prior_alpha
        # an estimator whose prior stands in for initial_prior (ChainAcceptance: later tokens start as first ones)
        self.follows: AcceptanceEstimator | None = None
        # pseudo-outcomes the prior is worth against a request's own; None: learned from finished requests
        self.fixed_strength = prior_strength
        self.strength_range = strength_range
        self.min_finished = min_finished  # finished requests needed before the strength is learned
        self.min_outcomes = min_outcomes  # a finished request counts toward it with at least this many outcomes
        self.finished: deque[tuple[float, float]] = deque(maxlen=finished_window)  # (accepted, outcomes)
        self._learned_strength: float | None = None  # relearned when a request finishes, not on every alpha()
        low, high = strength_range
        # before the strength is learned: the strengths a request's estimate is averaged over
        self.cold_strengths = [low * (high / low) ** (i / max(1, cold_strengths - 1)) for i in range(cold_strengths)]
        self.request_decay = request_decay
        self.clock = 0  # steps passed (tick); a request's counts decay by request_decay a step, read lazily
        self.prior_decay = prior_decay
        self.max_alpha = max_alpha  # alpha = 1 would make the goodput of k unbounded in k
        self._own_counts = Counts()  # this engine's own evidence (what it exports), as of the last fold
        self.shared_counts = Counts()  # other replicas' evidence, as last received (replaced, never accumulated)
        self.slots = RequestSlots(5)  # per request: the columns ACCEPTED .. TOTAL_REJECTED
        # steps' outcomes not yet counted (_fold): (clock, request ids, accepted, rejected)
        self._pending: list[tuple[int, list[str], np.ndarray, np.ndarray]] = []
        # (prior, the terms of _averaged_over_strengths that depend on it alone per strength, those terms as arrays)
        self._prior_terms: tuple | None = None
        self._unseen_estimate: float | None = None  # _unseen's, for the prior of _prior_terms

    @property
    def prior_counts(self) -> Counts:
        """This engine's own evidence for the prior (what it exports)."""
        self._fold()
        return self._own_counts

    @property
    def prior(self) -> float:
        own = self.prior_counts
        accepted = own.accepted + self.shared_counts.accepted
        rejected = own.rejected + self.shared_counts.rejected
        # the initial prior is itself worth a few observations, so one lucky request cannot swing it
        weight = self.fixed_strength if self.fixed_strength is not None else self.strength_range[0]
        initial = self.initial_prior if self.follows is None else self.follows.prior
        return min(self.max_alpha, (accepted + initial * weight) / (accepted + rejected + weight))

    @property
    def prior_strength(self) -> float:
        """Pseudo-outcomes the prior is worth: fixed, or learned; before it is learned, the middle (in log scale) of
        the strengths a request's estimate is averaged over."""
        if self.fixed_strength is not None:
            return self.fixed_strength
        if self._learned_strength is not None:
            return self._learned_strength
        return math.sqrt(self.strength_range[0] * self.strength_range[1])

    def _learn_strength(self) -> float | None:
        """Beta concentration of requests' acceptance around the prior, by moments over finished requests: the
        spread of their rates less the part their finite counts explain. Little spread left: a strong prior."""
        low, high = self.strength_range
        if len(self.finished) < self.min_finished:
            return None
        accepted = sum(a for a, _ in self.finished)
        outcomes = sum(n for _, n in self.finished)
        mean = accepted / outcomes
        spread = sum(n * (a / n - mean) ** 2 for a, n in self.finished) / outcomes
        between = spread - len(self.finished) * mean * (1 - mean) / outcomes
        if between <= 0:
            return high
        return min(high, max(low, mean * (1 - mean) / between - 1))

    @property
    def evidence(self) -> float:
        """Proposal outcomes (decayed) behind the prior: this engine's and the other replicas'."""
        own, shared = self.prior_counts, self.shared_counts
        return own.accepted + own.rejected + shared.accepted + shared.rejected

    def alpha(self, request_id: str) -> float:
        return float(self.alphas([request_id])[0])

    def alphas(self, request_ids: list[str]) -> np.ndarray:
        """Each request's estimate (the prior for one without evidence), for a whole batch at once."""
        self._fold()
        counts = self.slots.values[self.slots.rows_of(request_ids)]
        decayed = self.request_decay ** (self.clock - counts[:, AT])
        a, r = counts[:, ACCEPTED] * decayed, counts[:, REJECTED] * decayed
        prior = self.prior
        if self.fixed_strength is None and self._learned_strength is None:
            return np.minimum(self.max_alpha, self._averaged_over_strengths(a, r, prior))
        strength = self.prior_strength
        return np.minimum(self.max_alpha, (a + prior * strength) / (a + r + strength))

    def _averaged_over_strengths(self, a: np.ndarray, r: np.ndarray, prior: float) -> np.ndarray:
        """Requests' estimates averaged over cold_strengths, each weighted by the beta-binomial likelihood of
        the request's outcomes under a Beta(prior * s, (1 - prior) * s) acceptance (the binomial coefficient is the
        same for every s and drops out). a, r: [B]."""
        prior = min(max(prior, 1e-3), 1 - 1e-3)
        if self._prior_terms is None or self._prior_terms[0] != prior:  # the prior moves only when outcomes arrive
            # the prior's own terms in the exact log-gamma (C): every path reads these same floats, so a request's
            # estimate stays the same whatever batch it is in
            per_strength = tuple((s, prior * s, (1 - prior) * s, math.lgamma(prior * s), math.lgamma((1 - prior) * s),
                                  math.lgamma(s)) for s in self.cold_strengths)
            self._prior_terms = (prior, per_strength, tuple(np.array(column)[None, :] for column in zip(*per_strength)))
            self._unseen_estimate = None
        _, per_strength, terms = self._prior_terms
        if len(a) <= SCALAR_ROWS:
            return np.array([_strength_averaged_of_a_request(per_strength, x, y) if x or y else self._unseen()
                             for x, y in zip(a.tolist(), r.tolist())])
        seen = (a != 0) | (r != 0)
        out = np.full(len(seen), self._unseen() if not seen.all() else 0.0)
        if seen.any():
            out[seen] = _strength_averaged(terms, a[seen], r[seen])
        return out

    def _unseen(self) -> float:
        """The cold estimate of a request without outcomes (most of a batch the policy keeps at k = 0): once per
        prior, when first asked for."""
        if self._unseen_estimate is None:
            self._unseen_estimate = _strength_averaged_of_a_request(self._prior_terms[1], 0.0, 0.0)
        return self._unseen_estimate

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self.observe_many([request_id], np.array([proposed]), np.array([accepted]))

    def observe_many(self, request_ids: list[str], proposed: np.ndarray, accepted: np.ndarray) -> None:
        """A step's outcomes, one per request (proposed > 0 each): each request's own counts, and the prior's.
        Kept until an estimate is next read (_fold): a held plan reads none, and a few steps' outcomes are counted
        in the array operations of one."""
        self._pending.append((self.clock, list(request_ids), accepted.astype(np.float64),
                              (accepted < proposed).astype(np.float64)))

    def _fold(self) -> None:
        """Counts the steps' outcomes kept since the last fold: each request's counts decayed to the last of those
        steps, each outcome added decayed from its own step, totals undecayed, the prior's counts outcome by outcome
        in their order: the sums of counting each step as it came (to rounding)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        last = pending[-1][0]
        if len(pending) == 1:
            _, ids, taken, rejected = pending[0]
            add_taken, add_rejected, total_taken, total_rejected = taken, rejected, taken, rejected
        else:
            every = [rid for _, step_ids, _, _ in pending for rid in step_ids]
            ids = list(dict.fromkeys(every))
            position = {rid: i for i, rid in enumerate(ids)}
            index = np.array([position[rid] for rid in every], dtype=np.int64)
            taken, rejected = (np.concatenate([p[column] for p in pending]) for column in (2, 3))
            weight = self.request_decay ** (last - np.concatenate([np.full(len(p[1]), float(p[0])) for p in pending]))
            add_taken, add_rejected, total_taken, total_rejected = (
                np.bincount(index, values, len(ids)) for values in (taken * weight, rejected * weight, taken, rejected))
        rows = self.slots.rows_for(ids)
        counts = self.slots.values[rows]
        decayed = self.request_decay ** (last - counts[:, AT])
        counts[:, ACCEPTED] *= decayed
        counts[:, ACCEPTED] += add_taken
        counts[:, REJECTED] *= decayed
        counts[:, REJECTED] += add_rejected
        counts[:, AT] = last
        counts[:, TOTAL_ACCEPTED] += total_taken
        counts[:, TOTAL_REJECTED] += total_rejected
        self.slots.values[rows] = counts
        self._calibrate_many(taken, rejected)

    def counts(self, request_id: str) -> tuple[float, float, int]:
        """The request's accepted and rejected as of the step it last had an outcome, and that step."""
        self._fold()
        row = self.slots.values[self.slots.rows_of([request_id])[0]]
        return float(row[ACCEPTED]), float(row[REJECTED]), int(row[AT])

    def _calibrate_many(self, accepted: np.ndarray, rejected: np.ndarray) -> None:
        """The prior's counts after these outcomes in turn, each decaying the ones before by prior_decay: the
        same sums as one calibrate() per outcome, in one array operation."""
        n = len(accepted)
        weights = self.prior_decay ** np.arange(n - 1, -1, -1, dtype=np.float64)
        self._own_counts.decay(self.prior_decay ** n)
        self._own_counts.add(float(weights @ accepted), float(weights @ rejected))

    def calibrate(self, proposed: int, accepted: int) -> None:
        """An outcome that is evidence for the prior alone (no request's own): the engine's calibration, and the
        prior's share of every request's outcome."""
        if proposed <= 0:
            return
        self._fold()  # the outcomes before it come first
        self._own_counts.decay(self.prior_decay)
        self._own_counts.add(accepted, 1.0 if accepted < proposed else 0.0)

    def tick(self) -> None:
        """One step passed: every request's older evidence weighs less (with none new, toward the prior). Counted,
        not applied: a batch's counts are decayed when they are read (alphas, observe), not walked every step."""
        self.clock += 1

    def forget(self, request_id: str) -> None:
        self._fold()
        row = self.slots.pop(request_id)
        if row is not None and row[TOTAL_ACCEPTED] + row[TOTAL_REJECTED] >= max(1, self.min_outcomes):
            self.finished.append((float(row[TOTAL_ACCEPTED]), float(row[TOTAL_ACCEPTED] + row[TOTAL_REJECTED])))
            self._learned_strength = self._learn_strength()


class ChainAcceptance:
    """A chain draft's acceptance in two stages, each estimated per request as above: its first token, and each later
    token given the one before it was accepted. The expected tokens the j-th drafted token adds are then
    first * later^(j - 1).

    One rate for every depth (alpha^j) fits a draft model, whose tokens are about equally hard at every depth, but not
    prompt lookup, whose later tokens, after an accepted predecessor, are accepted far more often than its first
    (a copy that starts right goes on right; docs/policy.md). A single rate averages the two, so a
    rejected first token also lowered the value of every deeper one, and at batch 5 that made drafts of 1-2 tokens
    look best where the copy would have given five. Two stages keep a first-token miss where it belongs: it lowers
    every depth's value alike, so drafting either pays with a long chain or not at all. When the stages agree (a
    draft model), this is the single-rate model again."""

    def __init__(self, prior_alpha: float = 0.5) -> None:
        self.first = AcceptanceEstimator(prior_alpha=prior_alpha)
        self.later = AcceptanceEstimator(prior_alpha=prior_alpha)
        # until later tokens have been tried, guess them as likely accepted as first ones (the single-rate model).
        # A fixed guess would trap the policy: at k = 1 the later stage hears nothing, and a pessimistic guess
        # keeps k at 1 (a draft model whose every draft was accepted stayed at k = 1)
        self.later.follows = self.first

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        self.observe_step([request_id], [proposed], [accepted])

    def observe_step(self, request_ids: list[str], proposed: list[int], accepted: list[int]) -> None:
        """A step's outcomes, per request: its drafts proposed and accepted. The first stage hears every chain that
        proposed; the later stage, those that proposed two or more and had the first accepted (_stages)."""
        proposed_a, accepted_a = np.asarray(proposed, dtype=np.int64), np.asarray(accepted, dtype=np.int64)
        for stage, rows, tried, taken in ((self.first, proposed_a > 0, None, np.minimum(accepted_a, 1)),
                                          (self.later, (accepted_a >= 1) & (proposed_a >= 2), proposed_a - 1,
                                           accepted_a - 1)):
            if rows.all():  # the usual first stage: every request that drafted
                stage.observe_many(request_ids, np.ones(len(rows)) if tried is None else tried, taken)
            elif rows.any():
                index = np.flatnonzero(rows)
                stage.observe_many([request_ids[i] for i in index.tolist()],
                                   np.ones(len(index)) if tried is None else tried[index], taken[index])

    def calibrate(self, proposed: int, accepted: int) -> None:
        """A calibration draft's outcome (engine/profile.py): evidence for the priors, not for any request."""
        if proposed <= 0:
            return
        for stage, tried, taken in self._stages(proposed, accepted):
            stage.calibrate(tried, taken)

    def _stages(self, proposed: int, accepted: int) -> list[tuple[AcceptanceEstimator, int, int]]:
        """A chain's outcome (proposed > 0) per stage: its first token, then the later ones (tried only if the
        first was accepted)."""
        stages = [(self.first, 1, min(accepted, 1))]
        if accepted >= 1 and proposed >= 2:
            stages.append((self.later, proposed - 1, accepted - 1))
        return stages

    def tick(self) -> None:
        self.first.tick()
        self.later.tick()

    def forget(self, request_id: str) -> None:
        self.first.forget(request_id)
        self.later.forget(request_id)

    def gains(self, request_ids: list[str], k: int) -> np.ndarray:
        """[B, k]: the expected tokens the j-th drafted token of each request's chain adds."""
        return self.gains_and_ceiling(request_ids, k)[0]

    def gains_and_ceiling(self, request_ids: list[str], k: int) -> tuple[np.ndarray, float]:
        """gains, and the highest of the batch's estimates of either stage: every j-th token's gain is at most that
        to the j-th power (0 for an empty batch)."""
        first, later = self.first.alphas(request_ids), self.later.alphas(request_ids)
        ceiling = max(float(first.max()), float(later.max())) if len(first) else 0.0
        return first[:, None] * later[:, None] ** np.arange(k)[None, :], ceiling

    @property
    def evidence(self) -> float:
        return self.first.evidence + self.later.evidence

    def export_counts(self) -> dict:
        return {stage: {"accepted": e.prior_counts.accepted, "rejected": e.prior_counts.rejected}
                for stage, e in (("first", self.first), ("later", self.later))}

    def import_counts(self, counts: dict) -> None:
        """Other replicas' evidence, as last received: replaces what came before, never accumulates."""
        for stage, e in (("first", self.first), ("later", self.later)):
            if stage in counts:
                e.shared_counts = Counts(float(counts[stage]["accepted"]), float(counts[stage]["rejected"]))
