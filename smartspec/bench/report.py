"""The latency table and plot shared by the serving benchmark and the simulator (same columns, same figure)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

TABLE_COLUMNS = ["label", "rate", "concurrency", "requests", "errors", "latency_s_mean", "latency_s_p50",
                 "latency_s_p99", "ttft_s_mean", "tpot_s_mean", "throughput_tok_s", "acceptance_rate"]


def summarise(rows: list[dict], label: str, rate: float, wall_s: float, extra: dict | None = None) -> dict:
    ok = [r for r in rows if not r.get("error")]
    out = {"label": label, "rate": rate, "requests": len(rows), "errors": len(rows) - len(ok),
           "throughput_tok_s": sum(r["output_tokens"] for r in ok) / wall_s if wall_s > 0 else 0.0}
    for col in ("latency_s", "ttft_s", "tpot_s"):
        v = np.array([r[col] for r in ok if r.get(col) is not None], dtype=float)
        for name, value in (("mean", v.mean() if len(v) else None),
                            ("p50", np.percentile(v, 50) if len(v) else None),
                            ("p99", np.percentile(v, 99) if len(v) else None)):
            out[f"{col}_{name}"] = None if value is None else float(value)
    out.update(extra or {})
    return out


def print_table(summaries: list[dict]) -> None:
    cols = [c for c in TABLE_COLUMNS if any(c in s for s in summaries)]
    cells = [[_fmt(s.get(c)) for c in cols] for s in summaries]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _latency(summary: dict) -> float | None:
    """Mean latency; None where every request failed (None, or NaN once pooled, or no column at all)."""
    v = summary.get("latency_s_mean")
    return None if v is None or np.isnan(v) else v


def plot_latency_vs_rate(summaries: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(s["label"] for s in summaries):
        pts = sorted((s["rate"], _latency(s)) for s in summaries if s["label"] == label and _latency(s) is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("mean request latency (s)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def step_work(steps: list[dict], back_to_back_s: float = 0.05) -> dict:
    """What one replica's step trace (its rows, e.g. pyarrow.parquet.read_table(folder).to_pylist()) did and where
    its time went: whether two servers did the same work (steps, drafted and accepted tokens), and if so, whether
    one spent its time in the forward (the model on this box, at that hour) or around it. other_ms: median time of
    a step outside the target's forward and the drafting (scheduling, choosing k, acceptance, commit).
    between_steps_ms: a step's time outside any step, i.e. the time from one step's trace record to the next less
    the later step's own time (median, over steps that follow each other within back_to_back_s: an idle wait for
    a request is not overhead); it holds the policy's observe and cost refit, which run after the step is timed,
    and the serving loop."""
    steps = sorted(steps, key=lambda r: r["time"])
    total = np.array([r["total_s"] for r in steps], dtype=np.float64)
    forward = np.array([r["verify_s"] for r in steps], dtype=np.float64)
    draft = np.array([r["draft_s"] for r in steps], dtype=np.float64)
    gaps = np.diff([r["time"] for r in steps]) - total[1:]
    gaps = gaps[gaps < back_to_back_s]
    return {"steps": len(steps), "drafted": int(sum(sum(r["proposed"]) for r in steps)),
            "accepted": int(sum(sum(r["accepted"]) for r in steps)), "busy_s": float(total.sum()),
            "forward_s": float(forward.sum()), "draft_s": float(draft.sum()),
            "other_ms": float(np.median(total - forward - draft) * 1e3) if steps else None,
            "between_steps_ms": float(np.median(gaps) * 1e3) if len(gaps) else None}


def plain_forward_ratio(steps: list[dict], reference: list[dict], min_steps: int = 3) -> tuple[float, int] | None:
    """How fast the box ran one run's target forwards against another's, on work both runs did alike: plain decode
    steps (nothing drafted, no prefill), compared batch size by batch size (median forward seconds; a size counts
    where each run has at least min_steps such steps). Returns (the geometric mean of the per-size ratios, weighted
    by the steps compared; the steps compared), or None where the runs share no such size.

    On this box the same forward's speed drifts by 10-20% between runs minutes apart (memory bandwidth shared with
    other VMs), which swamps a 2% difference between policies. A policy does not change what a plain forward costs
    (measured with interleaved A/B runs of two policies on one request), so this ratio measures the box, and
    speed_adjusted reads the repeats' latency ratios where it is 1."""
    def by_batch(rows: list[dict]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for r in rows:
            if not sum(r["proposed"]) and not r["num_prefill_tokens"]:
                out.setdefault(r["batch_size"], []).append(r["verify_s"])
        return out

    ours, theirs = by_batch(steps), by_batch(reference)
    logs, weights = [], []
    for size in ours.keys() & theirs.keys():
        a, b = ours[size], theirs[size]
        if len(a) >= min_steps and len(b) >= min_steps:
            logs.append(np.log(np.median(a) / np.median(b)))
            weights.append(min(len(a), len(b)))
    if not logs:
        return None
    return float(np.exp(np.average(logs, weights=weights))), int(sum(weights))


def paired_ratio(ratios: list[float]) -> tuple[float, float]:
    """The geometric mean of per-repeat ratios and its standard error as a fraction (from the spread of their
    logs; 0 for a single repeat)."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    se = float(logs.std(ddof=1) / np.sqrt(len(logs))) if len(logs) > 1 else 0.0
    return float(np.exp(logs.mean())), se


def speed_adjusted(ratios: list[float], speeds: list[float]) -> tuple[float, float, float] | None:
    """The per-repeat latency ratios at equal box speed: the fit log(ratio) = a + b log(speed) over the repeats
    (speed: each repeat's plain_forward_ratio), read at speed 1. Returns (exp(a), its standard error as a
    fraction, b), or None with fewer than 3 repeats. The slope is fitted, not taken as 1: latency also holds work
    the plain forwards do not time (prefill, drafting, waiting), and each repeat's speed is itself measured on a
    few dozen steps (a noisy speed flattens the slope, which leaves the estimate nearer the raw mean, not past it)."""
    if len(ratios) < 3:
        return None
    y, x = np.log(np.asarray(ratios, dtype=np.float64)), np.log(np.asarray(speeds, dtype=np.float64))
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    try:
        cov = resid @ resid / (len(y) - 2) * np.linalg.inv(design.T @ design)
    except np.linalg.LinAlgError:  # every repeat ran at one speed: nothing to adjust for
        return None
    return float(np.exp(coef[0])), float(np.sqrt(cov[0, 0])), float(coef[1])
