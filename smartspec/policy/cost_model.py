"""Step time predicted from the step's shape, fitted online on measured steps.

    T = T_verify(N, C) + T_draft(depth, sum_k)
    T_verify = v0 + sum_j s_j clip(N - a_j, 0, b_j - a_j) + v_c C     N: batched tokens, C: context (a
                                                                  prefill chunk's: types/plan.py chunk_context)
    T_draft  = d0 depth + d1 sum_k (+ d2 catch-up tokens)             depth: max k, sum_k: draft tokens

T_verify is piecewise linear in N over the segments [0, 8], [8, 16], [16, 32], [32, 64], [64, 128], [128, inf):
s_j is the cost of a token within segment j, so the fit follows what is measured where cost is not linear in N
(a CPU's GEMV fast path, a kernel's row tile, a GPU's compute roof; prefill chunks of hundreds of tokens next to
decodes of a few). All coefficients are fitted non-negative, so the model is a cost by construction: positive and
non-decreasing in N and C. A segment the data never reached takes the slope of the last one it did.
T_verify here is everything in a step but drafting (verify forward, sampling, bookkeeping), so T predicts the
whole step. Catch-up (a draft model reading tokens it has not seen, a request's whole prompt the first time) is
fitted as its own term so that it does not inflate the per-step draft cost; the policy charges it once, when a
request starts drafting (GoodputPolicy). Windowed weighted least squares with exponential
forgetting by steps, not samples, refitted when the caller asks (GoodputPolicy: every few steps); a degenerate fit is
refused and the last good one kept. Drafting samples age with the steps that ran without drafts too: a draft cost
measured under a load long gone must not outweigh the one step that drafts today.

The fit leaves out steps that ran far slower than it predicts, by far more than steps usually disagree with it: a
shared or noisy machine now and then stalls a step for several times its usual time (a preempted core, a collector
pause), and plain least squares lets a handful of such steps bend the fitted shape, i.e. how much one more verified
token costs, which is what k is chosen on. A step that ran far faster than predicted is kept: no stall does that,
so it is a shape the fit has wrong (the policy runs such shapes now and then to find out; GoodputPolicy). A
sustained change of speed is not a stall: when nearly every step of the last few dozen ran well off the fit, in
the same direction, the steps before them are forgotten (SpeedChange, forget_before), and the fit starts again from
the recent steps and the profile's shape.

Each fit is drawn toward the warm-up profile's (hold_prior) with the weight of a few steps: running data can move
two features only together, and their split is then the profile's, not noise's. The profile lends its shape, not its
level: it is scaled to the speed the recent steps ran at (`prior_level`), so a profile taken on a loaded machine
does not keep a quiet machine's fit, nor the draft cost it has not re-measured since, at the loaded speed."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from smartspec.policy.speed_change import SpeedChange

SEGMENTS = ((0, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, float("inf")))
_SCALARS = (int, float, np.integer, np.floating)
_SEGMENT_STARTS = np.array([a for a, _ in SEGMENTS])
_SEGMENT_WIDTHS = np.array([b - a for a, b in SEGMENTS])
SEGMENT_EDGES = _SEGMENT_STARTS[1:]  # the token counts where a step's cost may change slope


def segment_tokens(n) -> np.ndarray:
    """[..., 6]: how many of n tokens (a number or an array) fall in each segment [a, b) of SEGMENTS, all segments
    in one array operation (the policy predicts a few dozen step shapes a step). np.minimum/np.maximum, not np.clip:
    the same values, without clip's overhead."""
    return np.minimum(np.maximum(np.asarray(n, dtype=np.float64)[..., None] - _SEGMENT_STARTS, 0.0), _SEGMENT_WIDTHS)


def _segment_tokens_of_a_number(n, a: float, b: float):
    """One segment of segment_tokens in Python floats: the same values, without numpy's overhead on 0-d values."""
    return min(max(n - a, 0.0), b - a)


def verify_features(n: np.ndarray, c: np.ndarray) -> np.ndarray:
    """One row per step: [1, tokens within each segment of SEGMENTS, context tokens]."""
    n = np.asarray(n, dtype=np.float64)
    return np.concatenate([np.ones_like(n)[..., None], segment_tokens(n), np.asarray(c, dtype=np.float64)[..., None]],
                          axis=-1)


def verify_seconds(v: list[float], n, c):
    """A verify step's seconds under coefficients v ([v0, a slope per segment, v_c]); n, c: numbers or numpy
    arrays."""
    t = v[0] + v[-1] * c
    if isinstance(n, _SCALARS):
        for slope, (a, b) in zip(v[1:-1], SEGMENTS):
            if slope:
                t = t + slope * _segment_tokens_of_a_number(n, a, b)
        return t
    # summed in the order the numbers' path sums them, so that a shape costs the same float either way; a segment
    # every n fills adds its whole width and one none reaches adds nothing, each without an array of its own (a
    # plan prices thousands of shapes at once, nearly all of them past the first segments)
    n = np.asarray(n, dtype=np.float64)
    low, high = (float(n.min()), float(n.max())) if n.size else (0.0, 0.0)
    for slope, (a, b) in zip(v[1:-1], SEGMENTS):
        if slope and high > a:
            t = t + (slope * (b - a) if low >= b else slope * np.minimum(np.maximum(n - a, 0.0), b - a))
    shape = np.broadcast_shapes(np.shape(t), n.shape)
    return t if np.shape(t) == shape else np.broadcast_to(t, shape).copy()


def draft_seconds(d: list[float], depth, sum_k, catchup=0):
    """Drafting's seconds under coefficients d ([per draft forward, per draft token, per catch-up token])."""
    return d[0] * depth + d[1] * sum_k + d[2] * catchup


class NormalEquations:
    """Weighted ridge least squares on standardised columns (features span 1 to thousands of tokens), drawn toward
    a prior, as normal equations over every feature: a fit on some of the features solves the rows and columns of
    those (each column's scale, ridge and prior term are its own), so the active set of nonnegative_lstsq drops a
    feature without building the system again (a refit's dozen solves were most of its time).

    Drawn toward prior: a coefficient's departure from it costs what it would on prior_weight steps that spread its
    feature as the data does. A feature the data holds constant (the base cost's) is drawn only by the ridge, and one
    it moves only together with another is split as the prior splits it; the ridge too draws toward the prior, so
    that where the data cannot tell features apart at all (one shape, after a change of speed), the fit departs
    from the prior, scaled to the data's level, no more than the data asks."""

    def __init__(self, x: np.ndarray, y: np.ndarray, w: np.ndarray, ridge: float, prior: np.ndarray | None,
                 prior_weight: float) -> None:
        sw = np.sqrt(w)[:, None]
        a = x * sw
        scale = np.sqrt((a * a).mean(axis=0))
        scale[scale == 0] = 1.0
        a = a / scale
        diagonal = np.full(a.shape[1], ridge * len(a))
        rhs = a.T @ (y * sw[:, 0])
        if prior is not None:
            spread = w @ (x - (w @ x) / w.sum()) ** 2  # sum of w (x - mean)^2, per feature
            diagonal += prior_weight * spread / w.sum() / scale ** 2
            rhs += diagonal * prior * scale  # the ridge too: where the data cannot tell, nearest the prior
        self.gram, self.rhs, self.scale = a.T @ a + np.diag(diagonal), rhs, scale

    def solve(self, cols: np.ndarray) -> np.ndarray | None:
        """The coefficients of the features at `cols` (indices), the others left out; None where singular."""
        try:
            coef = np.linalg.solve(self.gram[np.ix_(cols, cols)], self.rhs[cols]) / self.scale[cols]
        except np.linalg.LinAlgError:
            return None
        return coef if np.isfinite(coef).all() else None


def nonnegative_lstsq(equations: NormalEquations, usable: list[bool]) -> np.ndarray | None:
    """Least squares with every coefficient >= 0: solve, drop the most negative term, repeat (an active set)."""
    cols = np.array(usable, dtype=bool)
    while cols.any():
        taken = np.flatnonzero(cols)
        coef = equations.solve(taken)
        if coef is None:
            return None
        full = np.zeros(len(cols))
        full[taken] = coef
        if (full >= 0).all():
            return full
        cols[int(np.argmin(full))] = False
    return None


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


@dataclass(frozen=True)
class CostFitSettings:
    """How StepCostModel fits: the steps it keeps and how they age, its ridge, the robust fit's cut and rounds,
    the profile prior's weight, and what reads as a change of speed (SpeedChange)."""
    window: int = 256  # steps kept
    forget: float = 0.99  # a step's weight a step later
    ridge: float = 1e-6
    min_samples: int = 4
    # a step whose relative residual lies this many robust deviations from the typical one is left out of the
    # fit (0: plain least squares); robust_rounds: refits at most, until the set left out stops changing
    outlier_cut: float = 3.5
    robust_rounds: int = 4
    prior_weight: float = 4.0  # steps the warm-up profile's fit weighs as (hold_prior)
    change_steps: int = 16
    change_factor: float = 1.3


class StepCostModel:
    def __init__(self, settings: CostFitSettings = CostFitSettings()) -> None:
        self.window = window = settings.window
        self.outlier_cut = settings.outlier_cut
        self.robust_rounds = settings.robust_rounds
        self.forget = settings.forget
        self.ridge = settings.ridge
        self.min_samples = settings.min_samples
        self.steps = 0  # steps observed: the clock samples age by
        self.verify_samples: deque = deque(maxlen=window)  # (n, c, seconds, step)
        self.draft_samples: deque = deque(maxlen=window)  # (depth, sum_k, catch-up tokens, seconds, step)
        self.v: list[float] | None = None  # last good verify coefficients: [v0, s_1..s_6, v_c]
        self.d: list[float] = [0.0, 0.0, 0.0]  # draft coefficients (zero until drafting is measured)
        self.refused = 0
        # the warm-up profile's fit, which the running fit is drawn toward with the weight of prior_weight steps
        # (see hold_prior); None until held
        self.prior_weight = settings.prior_weight
        self.v_prior: np.ndarray | None = None
        self.d_prior: np.ndarray | None = None
        # relative errors of the fit's prediction of each step, for the shape that step really had (made before
        # the step is added to the fit)
        self.errors: deque = deque(maxlen=window)
        # a run of steps far off the fit after steps it predicted well: a load came or went (see forget_before)
        self.speed = SpeedChange(settings.change_steps, settings.change_factor)

    # ---- prediction ---------------------------------------------------------------------------------------
    @property
    def context_slope(self) -> float:
        """Seconds a step's cost rises per context token (v_c): the same for every shape of step."""
        return self.v[-1]

    @property
    def ready(self) -> bool:
        return self.v is not None

    def predict_verify(self, n, c):
        """n, c: numbers or numpy arrays."""
        return verify_seconds(self.v, n, c)

    def predict_draft(self, depth, sum_k, catchup=0):
        return draft_seconds(self.d, depth, sum_k, catchup)

    def predict(self, n, c, depth=0, sum_k=0):
        return self.predict_verify(n, c) + self.predict_draft(depth, sum_k)

    # ---- fitting --------------------------------------------------------------------------------------------
    def observe(self, n: int, c: int, depth: int, sum_k: int, draft_s: float, rest_s: float,
                catchup: int = 0, refit: bool = True) -> float | None:
        """refit=False only records the step (to fit once after many, with refit()). Returns how far the fit before
        it missed the step, relative to its time: (measured - predicted) / measured, positive where it ran slower
        (None: no fit yet)."""
        miss = None
        if self.v is not None and rest_s + draft_s > 0:  # how well the current fit predicts this step's shape
            predicted = self.predict(n, c, depth, sum_k) + self.d[2] * catchup
            miss = (rest_s + draft_s - predicted) / (rest_s + draft_s)
            self.errors.append(abs(miss))
            v, d = self.speed.reference_of((self.v, self.d))
            # in Python floats, as predict does: this runs every step, and numpy on one row costs more than the sum
            expected = float(verify_seconds(v, n, c) + draft_seconds(d, depth, sum_k, catchup))
            changed_since = self.speed.observe((rest_s + draft_s) / expected) if expected > 0 else 0
            if changed_since:  # this step and the changed_since - 1 before it ran at the new speed
                self.forget_before(self.steps + 1 - changed_since)
        self.steps += 1
        self.verify_samples.append((n, c, rest_s, self.steps))
        if depth > 0:
            self.draft_samples.append((depth, sum_k, catchup, draft_s, self.steps))
        if refit:
            self.refit(draft=depth > 0)
        return miss

    @property
    def speed_changes(self) -> int:
        return self.speed.changes

    def forget_before(self, step: int) -> None:
        """Forget the steps up to `step`: the machine's speed changed after it (SpeedChange). The fit then rests on
        the steps since and on the profile's shape at their speed (prior_level). Kept, a slow past and a fast
        present are told apart only by the shapes each ran: a draft length that ran only under the load is priced
        at the loaded speed, the policy stops running it (or runs nothing else), and only forgetting, over a
        hundred steps and more, undoes it."""
        self.verify_samples = deque((s for s in self.verify_samples if s[-1] > step), maxlen=self.window)
        self.draft_samples = deque((s for s in self.draft_samples if s[-1] > step), maxlen=self.window)

    def hold_prior(self) -> None:
        """Keep the current fit (the warm-up profile's, which ran chosen shapes) as the prior of every later fit.

        Running data alone can leave the fit's shape undetermined: in steady decoding at one draft length, batched
        tokens and context both grow with the batch, and their split, which k is chosen on, is then whatever noise
        makes it. The profile measured tokens and context apart; drawn toward it with the weight of a few steps,
        the fit keeps its split where the data cannot tell, and follows the data wherever the data can."""
        self.v_prior = None if self.v is None else np.array(self.v)
        self.d_prior = np.array(self.d) if self.draft_samples else None
        # the profile's draft steps live on in d_prior alone: the running draft fit rests on served steps, so a
        # profile that priced the draft wrong (a draft actor busy with something else) is judged by them
        self.draft_samples.clear()
        if self.v is not None:
            self.speed.profiled()

    def refit(self, draft: bool = True) -> None:
        """draft=False: no step since the last fit drafted, so the draft fit is kept, unless a profile is held: its
        level follows every step's speed, and so does the draft cost drawn toward it."""
        data = np.array(self.verify_samples, dtype=np.float64).reshape(-1, 4)
        level = self.prior_level(data)
        if draft or self.d_prior is not None:
            self._fit_draft(level)
        self._fit_verify(data, level)

    def _weights(self, stamps: np.ndarray) -> np.ndarray:
        return self.forget ** (self.steps - stamps)

    def prior_level(self, data: np.ndarray) -> float:
        """How fast the steps in data (verify_samples as an array) ran against the profile's fit of the same
        shapes: the weighted median of measured over predicted seconds (1.0 without a profile). A median, not a
        least-squares scale: the profile ran decodes only, and a long prompt's prefill chunks, each worth twenty
        decode steps in seconds, are predicted from its slopes far beyond the shapes it ran; one long prompt
        served at the profile's speed set a least-squares level of 0.22, and every prior with it."""
        if self.v_prior is None or not len(data):
            return 1.0
        predicted = verify_features(data[:, 0], data[:, 1]) @ self.v_prior
        usable = predicted > 0
        if not usable.any():
            return 1.0
        return weighted_median(data[usable, 2] / predicted[usable], self._weights(data[usable, 3]))

    def _fit_verify(self, data: np.ndarray, level: float) -> None:
        if len(data) < self.min_samples:
            return
        x = verify_features(data[:, 0], data[:, 1])
        reached = [bool((data[:, 0] > a).any()) for a, _ in SEGMENTS]
        prior = None if self.v_prior is None else self.v_prior * level
        coef = self._robust_fit(x, data[:, 2], self._weights(data[:, 3]), [True] + reached + [True], prior)
        if coef is None or coef[0] <= 0:  # no positive base cost: not a fit to trust
            self.refused += 1
            return
        last = 0.0
        for j, hit in enumerate(reached, start=1):  # beyond the data: the last measured slope goes on
            last = coef[j] if hit else last
            coef[j] = coef[j] if hit else last
        self.v = coef.tolist()

    def _fit_draft(self, level: float) -> None:
        """The draft's prior is the profile's at the draft's own level: the weighted median of served draft steps'
        time over the prior's prediction. Before any has run, at the verify steps' level (drafting runs on the same
        machine, and a draft cost is re-measured only when the policy drafts, which a fit at a loaded speed may
        never choose again). Its own level, not the verify steps': a profile that overpriced the draft alone (6x,
        15x) kept a quiet machine at k = 0 for good, since at k = 0 nothing re-measures the draft; one served draft
        step now sets its price (GoodputPolicy runs one now and then: DraftPriceCheck)."""
        data = np.array(self.draft_samples, dtype=np.float64).reshape(-1, 5)
        prior = None if self.d_prior is None else self.d_prior * self.draft_level(data, level)
        if len(data) < 2:
            if prior is not None:
                self.d = prior.tolist()
            return
        coef = self._robust_fit(data[:, :3], data[:, 3], self._weights(data[:, 4]),
                                [True, True, bool(data[:, 2].any())], prior)
        if coef is not None:
            self.d = coef.tolist()

    def draft_level(self, data: np.ndarray, verify_level: float) -> float:
        """How fast the draft steps in data (draft_samples as an array) ran against the profile's draft fit: the
        weighted median of measured over predicted seconds; verify_level where none was predicted a time."""
        if self.d_prior is None or not len(data):
            return verify_level
        predicted = data[:, :3] @ self.d_prior
        usable = predicted > 0
        if not usable.any():
            return verify_level
        return weighted_median(data[usable, 3] / predicted[usable], self._weights(data[usable, 4]))

    def _robust_fit(self, x: np.ndarray, y: np.ndarray, w: np.ndarray, usable: list[bool],
                    prior: np.ndarray | None = None) -> np.ndarray | None:
        """Non-negative least squares without the outliers: r, each step's residual relative to its measured time;
        a step is left out when r - m > outlier_cut * s (slower than typical: a stall), m the weighted median of r
        and s the weighted median of |r - m| / 0.6745 (at least 1%, so an almost exact fit does not turn ordinary
        jitter into outliers).
        Deviations are taken from the median residual, not from zero: stalls drag a plain fit above the typical
        step, and then the typical steps, not the stalls, are the ones that agree with each other. Left out means
        weight 0: a bounded weight (Huber's) still let a few stalls at short shapes tilt the slope negative."""
        coef = nonnegative_lstsq(NormalEquations(x, y, w, self.ridge, prior, self.prior_weight), usable)
        kept = np.ones(len(y), dtype=bool)
        for _ in range(self.robust_rounds if self.outlier_cut > 0 else 0):
            if coef is None:
                return None
            r = (y - x @ coef) / np.maximum(np.abs(y), 1e-9)
            middle = weighted_median(r, w)
            scale = max(weighted_median(np.abs(r - middle), w) / 0.6745, 0.01)
            now_kept = r - middle <= self.outlier_cut * scale
            if (now_kept == kept).all():
                break
            kept = now_kept
            coef = nonnegative_lstsq(NormalEquations(x[kept], y[kept], w[kept], self.ridge, prior, self.prior_weight),
                                     usable)
        return coef

    # ---- state exchange -------------------------------------------------------------------------------------
    @property
    def mean_relative_error(self) -> float | None:
        return float(np.mean(self.errors)) if self.errors else None

    def export_state(self) -> dict:
        return {"verify": self.v, "draft": list(self.d), "samples": len(self.verify_samples),
                "mean_relative_error": self.mean_relative_error}

    def import_state(self, state: dict) -> None:
        """Adopt shared coefficients only while this replica has too few measurements of its own."""
        if state.get("verify") and len(self.verify_samples) < self.min_samples:
            self.v = list(state["verify"])
        if state.get("draft") and len(self.draft_samples) < 2 and self.d_prior is None:
            self.d = (list(state["draft"]) + [0.0, 0.0, 0.0])[:3]
