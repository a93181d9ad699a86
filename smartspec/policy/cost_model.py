"""Step time predicted from the step's shape, fitted online on measured steps.

    T = T_verify(N, C) + T_draft(depth, sum_k)
    T_verify = v0 + v1 N + v2 C + sum_j h_j max(0, N - knot_j)    N: batched tokens, C: context tokens
    T_draft  = d0 depth + d1 sum_k (+ d2 catch-up tokens)          depth: max k, sum_k: draft tokens

Catch-up (a draft model reading a request's tokens it has not seen, its whole prompt the first time) is fitted as
its own term, so that it does not inflate the per-step draft cost; predictions for choosing k leave it out: it is
paid once per request, whatever k is chosen afterwards.

The hinge terms let the fit follow what is measured where cost is not linear in N (a CPU's GEMV fast path, a
kernel's row tile, a GPU's compute roof). T_verify here is everything in a step but drafting (verify forward,
sampling, bookkeeping), so that T predicts the whole step. Windowed weighted least squares with exponential
forgetting, refitted on every step; a fit that predicts a non-positive or decreasing cost anywhere on the
operating range is refused and the last good one kept."""
from __future__ import annotations

from collections import deque

import numpy as np

KNOTS = (8, 16, 32, 64, 128)


def verify_features(n: float, c: float) -> list[float]:
    return [1.0, n, c] + [max(0.0, n - k) for k in KNOTS]


class StepCostModel:
    def __init__(self, window: int = 256, forget: float = 0.99, ridge: float = 1e-6, max_tokens: int = 256,
                 min_samples: int = 4) -> None:
        self.window = window
        self.forget = forget
        self.ridge = ridge
        self.max_tokens = max_tokens
        self.min_samples = min_samples
        self.verify_samples: deque = deque(maxlen=window)  # (n, c, seconds)
        self.draft_samples: deque = deque(maxlen=window)  # (depth, sum_k, catch-up tokens, seconds)
        self.v: list[float] | None = None  # last good verify coefficients
        self.d: list[float] = [0.0, 0.0, 0.0]  # draft coefficients (zero until drafting is measured)
        self.refused = 0
        self.errors: deque = deque(maxlen=window)  # relative prediction errors of whole steps

    # ---- prediction ---------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.v is not None

    def predict_verify(self, n, c):
        """n, c: numbers or numpy arrays."""
        v = self.v
        t = v[0] + v[1] * n + v[2] * c
        for h, k in zip(v[3:], KNOTS):
            if h:
                t = t + h * np.maximum(0.0, n - k)
        return t

    def predict_draft(self, depth, sum_k, catchup=0):
        return self.d[0] * depth + self.d[1] * sum_k + self.d[2] * catchup

    def predict(self, n, c, depth=0, sum_k=0):
        return self.predict_verify(n, c) + self.predict_draft(depth, sum_k)

    # ---- fitting --------------------------------------------------------------------------------------------
    def observe(self, n: int, c: int, depth: int, sum_k: int, draft_s: float, rest_s: float,
                predicted_s: float | None = None, catchup: int = 0) -> None:
        if predicted_s is not None and rest_s + draft_s > 0:
            self.errors.append(abs(predicted_s - (rest_s + draft_s)) / (rest_s + draft_s))
        self.verify_samples.append((n, c, rest_s))
        if depth > 0:
            self.draft_samples.append((depth, sum_k, catchup, draft_s))
            self._fit_draft()
        self._fit_verify()

    def _weights(self, count: int) -> np.ndarray:
        return self.forget ** np.arange(count - 1, -1, -1, dtype=np.float64)

    def _fit_verify(self) -> None:
        """The hinge model if it is sane; else a plain linear one; else linear with non-negative slopes (always
        sane once its intercept is positive): timing noise can bend a flexible fit, never stall the policy."""
        if len(self.verify_samples) < self.min_samples:
            return
        data = np.array(self.verify_samples, dtype=np.float64)
        x = np.array([verify_features(n, c) for n, c, _ in data])
        y, w = data[:, 2], self._weights(len(data))
        c_max = float(data[:, 1].max())
        # hinges the data never reaches carry no information: leave them out (coefficient 0)
        hinges = [bool((data[:, 0] > k).any()) for k in KNOTS]
        for cols in ([True, True, True] + hinges, [True, True, True] + [False] * len(KNOTS)):
            coef = self._solve(x[:, cols], y, w)
            if coef is None:
                continue
            full = np.zeros(len(cols))
            full[np.array(cols)] = coef
            if self._sane(full.tolist(), c_max):
                self.v = full.tolist()
                return
            self.refused += 1
        if self.v is None:  # nothing good yet: the simplest model that is a cost
            slopes = self._solve(x[:, :3], y, w)
            v1, v2 = (max(0.0, float(slopes[1])), max(0.0, float(slopes[2]))) if slopes is not None else (0.0, 0.0)
            v0 = float(np.average(y - v1 * x[:, 1] - v2 * x[:, 2], weights=w))
            if v0 <= 0:  # a constant: the mean step time
                v0, v1, v2 = float(np.average(y, weights=w)), 0.0, 0.0
            if v0 > 0:
                self.v = [v0, v1, v2] + [0.0] * len(KNOTS)

    def _fit_draft(self) -> None:
        """Non-negative coefficients: terms that fit negative are dropped and the rest refitted."""
        if len(self.draft_samples) < 2:
            return
        data = np.array(self.draft_samples, dtype=np.float64)
        x, y, w = data[:, :3], data[:, 3], self._weights(len(data))
        cols = [True, True, bool(data[:, 2].any())]
        while any(cols):
            coef = self._solve(x[:, cols], y, w)
            if coef is None:
                return
            full = np.zeros(3)
            full[np.array(cols)] = coef
            if (full >= 0).all():
                self.d = full.tolist()
                return
            cols[int(np.argmin(full))] = False

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

    def _sane(self, v: list[float], c_max: float) -> bool:
        """Positive and non-decreasing in N over the operating range, and non-decreasing in C."""
        if v[2] < 0:
            return False
        saved, self.v = self.v, v
        try:
            grid = [self.predict_verify(n, c_max) for n in range(1, self.max_tokens + 1)]
            low = self.predict_verify(1, 0.0)
        finally:
            self.v = saved
        return low > 0 and all(b >= a - 1e-9 for a, b in zip(grid, grid[1:]))

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
