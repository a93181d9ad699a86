"""Step time predicted from the step's shape, fitted online on measured steps.

    T = T_verify(N, C) + T_draft(depth, sum_k)
    T_verify = v0 + sum_j s_j clip(N - a_j, 0, b_j - a_j) + v_c C     N: batched tokens, C: context tokens
    T_draft  = d0 depth + d1 sum_k (+ d2 catch-up tokens)             depth: max k, sum_k: draft tokens

T_verify is piecewise linear in N over the segments [0, 8], [8, 16], [16, 32], [32, 64], [64, 128], [128, inf):
s_j is the cost of a token within segment j, so the fit follows what is measured where cost is not linear in N
(a CPU's GEMV fast path, a kernel's row tile, a GPU's compute roof; prefill chunks of hundreds of tokens next to
decodes of a few). All coefficients are fitted non-negative, so the model is a cost by construction: positive and
non-decreasing in N and C. A segment the data never reached takes the slope of the last one it did.
T_verify here is everything in a step but drafting (verify forward, sampling, bookkeeping), so T predicts the
whole step. Catch-up (a draft model reading tokens it has not seen, a request's whole prompt the first time) is
fitted as its own term so that it does not inflate the per-step draft cost; the policy charges it once, when a
request starts drafting (SmartSpecPolicy). Windowed weighted least squares with exponential
forgetting, refitted on every step; a degenerate fit is refused and the last good one kept."""
from __future__ import annotations

from collections import deque

import numpy as np

SEGMENTS = ((0, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, float("inf")))


def verify_features(n: float, c: float) -> list[float]:
    return [1.0] + [min(max(n - a, 0.0), b - a) for a, b in SEGMENTS] + [c]


def nonnegative_lstsq(solve, x: np.ndarray, y: np.ndarray, w: np.ndarray, usable: list[bool]) -> np.ndarray | None:
    """Least squares with every coefficient >= 0: solve, drop the most negative term, repeat (an active set)."""
    cols = list(usable)
    while any(cols):
        coef = solve(x[:, cols], y, w)
        if coef is None:
            return None
        full = np.zeros(len(cols))
        full[np.array(cols)] = coef
        if (full >= 0).all():
            return full
        cols[int(np.argmin(full))] = False
    return None


class StepCostModel:
    def __init__(self, window: int = 256, forget: float = 0.99, ridge: float = 1e-6, min_samples: int = 4) -> None:
        self.window = window
        self.forget = forget
        self.ridge = ridge
        self.min_samples = min_samples
        self.verify_samples: deque = deque(maxlen=window)  # (n, c, seconds)
        self.draft_samples: deque = deque(maxlen=window)  # (depth, sum_k, catch-up tokens, seconds)
        self.v: list[float] | None = None  # last good verify coefficients: [v0, s_1..s_6, v_c]
        self.d: list[float] = [0.0, 0.0, 0.0]  # draft coefficients (zero until drafting is measured)
        self.refused = 0
        # relative errors of the fit's prediction of each step, for the shape that step really had (made before
        # the step is added to the fit)
        self.errors: deque = deque(maxlen=window)

    # ---- prediction ---------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.v is not None

    def predict_verify(self, n, c):
        """n, c: numbers or numpy arrays."""
        v = self.v
        t = v[0] + v[-1] * c
        for slope, (a, b) in zip(v[1:-1], SEGMENTS):
            if slope:
                t = t + slope * np.clip(n - a, 0.0, b - a)
        return t

    def predict_draft(self, depth, sum_k, catchup=0):
        return self.d[0] * depth + self.d[1] * sum_k + self.d[2] * catchup

    def predict(self, n, c, depth=0, sum_k=0):
        return self.predict_verify(n, c) + self.predict_draft(depth, sum_k)

    # ---- fitting --------------------------------------------------------------------------------------------
    def observe(self, n: int, c: int, depth: int, sum_k: int, draft_s: float, rest_s: float,
                catchup: int = 0, refit: bool = True) -> None:
        """refit=False only records the step (to fit once after many, with refit())."""
        if self.v is not None and rest_s + draft_s > 0:  # how well the current fit predicts this step's shape
            predicted = self.predict(n, c, depth, sum_k) + self.d[2] * catchup
            self.errors.append(abs(predicted - (rest_s + draft_s)) / (rest_s + draft_s))
        self.verify_samples.append((n, c, rest_s))
        if depth > 0:
            self.draft_samples.append((depth, sum_k, catchup, draft_s))
        if refit:
            self.refit(draft=depth > 0)

    def refit(self, draft: bool = True) -> None:
        if draft:
            self._fit_draft()
        self._fit_verify()

    def _weights(self, count: int) -> np.ndarray:
        return self.forget ** np.arange(count - 1, -1, -1, dtype=np.float64)

    def _fit_verify(self) -> None:
        if len(self.verify_samples) < self.min_samples:
            return
        data = np.array(self.verify_samples, dtype=np.float64)
        x = np.array([verify_features(n, c) for n, c, _ in data])
        reached = [bool((data[:, 0] > a).any()) for a, _ in SEGMENTS]
        coef = nonnegative_lstsq(self._solve, x, data[:, 2], self._weights(len(data)), [True] + reached + [True])
        if coef is None or coef[0] <= 0:  # no positive base cost: not a fit to trust
            self.refused += 1
            return
        last = 0.0
        for j, hit in enumerate(reached, start=1):  # beyond the data: the last measured slope goes on
            last = coef[j] if hit else last
            coef[j] = coef[j] if hit else last
        self.v = coef.tolist()

    def _fit_draft(self) -> None:
        if len(self.draft_samples) < 2:
            return
        data = np.array(self.draft_samples, dtype=np.float64)
        coef = nonnegative_lstsq(self._solve, data[:, :3], data[:, 3], self._weights(len(data)),
                                 [True, True, bool(data[:, 2].any())])
        if coef is not None:
            self.d = coef.tolist()

    def _solve(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray | None:
        """Weighted ridge least squares on standardised columns (features span 1 to thousands of tokens)."""
        sw = np.sqrt(w)[:, None]
        a = x * sw
        scale = np.sqrt((a * a).mean(axis=0))
        scale[scale == 0] = 1.0
        a = a / scale
        gram = a.T @ a + self.ridge * len(a) * np.eye(a.shape[1])
        try:
            coef = np.linalg.solve(gram, a.T @ (y * sw[:, 0])) / scale
        except np.linalg.LinAlgError:
            return None
        return coef if np.isfinite(coef).all() else None

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
        if state.get("draft") and len(self.draft_samples) < 2:
            self.d = (list(state["draft"]) + [0.0, 0.0, 0.0])[:3]
