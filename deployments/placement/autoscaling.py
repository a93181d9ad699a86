"""Autoscaling on the replicas' own measure of what load costs (`autoscaling: {policy: goodput}`, the default
when autoscaling is set; `policy: ongoing` is Serve's rule on target_ongoing_requests alone).

Each replica reports, through Serve's `record_autoscaling_stats`, its requests in flight and its request speed:
the tokens per second one request gets at batch sizes 1, 2, 4, ... (`Policy.load.request_speed`: the fitted step cost
and the measured acceptance at the k the policy would choose). Serve's controller calls `goodput_policy` about
once a second with those numbers averaged over `look_back_period_s`; it answers the smallest replica count n
whose share of the load, b = ceil(requests / n) per replica, keeps each request at least `min_speed_fraction` of
the speed it would get alone:

    speed(b) >= min_speed_fraction * speed(1),    speed(b) = speed(max_num_seqs) * max_num_seqs / b beyond it

(beyond max_num_seqs, requests queue: the batch's speed is shared by more requests). So the replicas scale up when
the batch has grown past what speculation and batching absorb, and down when one fewer replica would still keep
every request that fast. Until a replica's policy has a step-cost fit (no speculation, or its first seconds),
the rule is Serve's: ceil(requests / target_ongoing_requests). Serve applies min_replicas, max_replicas,
upscale_delay_s and downscale_delay_s on top; a replica removed on scale-down first drains its requests (up to
the deployment's graceful shutdown timeout, `drain_timeout_s`)."""
from __future__ import annotations

import math

SPEED_PREFIX = "speed_b"  # autoscaling metric "speed_b<b>": tokens/s of one request at batch b


def autoscaling_metrics(in_flight: int, max_num_seqs: int, request_speed: dict[int, float] | None) -> dict:
    """What a replica reports to Serve's autoscaler (numbers only)."""
    metrics = {"ongoing": float(in_flight), "max_num_seqs": float(max_num_seqs)}
    for b, speed in (request_speed or {}).items():
        metrics[f"{SPEED_PREFIX}{int(b)}"] = float(speed)
    return metrics


def interpolate(table: dict[int, float], batch: float) -> float:
    """A speed table (batch size -> tokens/s of one request) read at `batch`: linear between its sizes, flat
    beyond them. (The router reads tables with it too; this module imports nothing of the project, since Serve's
    controller runs the policy without the application's code.)"""
    sizes = sorted(table)
    if batch <= sizes[0]:
        return table[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if batch <= hi:
            return table[lo] + (table[hi] - table[lo]) * (batch - lo) / (hi - lo)
    return table[sizes[-1]]


def speed_at(table: dict[int, float], batch: float, max_num_seqs: int) -> float:
    """A request's speed with `batch` requests on the replica; beyond max_num_seqs the full batch's speed shared
    among all."""
    speed = interpolate(table, min(batch, max_num_seqs))
    return speed * (max_num_seqs / batch if batch > max_num_seqs else 1.0)


def desired_replicas(requests: float, table: dict[int, float] | None, max_num_seqs: int, current: int,
                     max_replicas: int, min_speed_fraction: float, target_ongoing_requests: float) -> int:
    """The smallest replica count that keeps every request at min_speed_fraction of its speed alone (see the
    module docstring); Serve's rule where there is no speed table yet."""
    if requests <= 0:
        return 0  # Serve keeps min_replicas
    if not table:
        return math.ceil(requests / target_ongoing_requests)
    alone = table[min(table)]
    for n in range(1, max(max_replicas, current) + 1):
        if speed_at(table, math.ceil(requests / n), max_num_seqs) >= min_speed_fraction * alone:
            return n
    return max(max_replicas, current)


def merged_table(metrics: dict[str, dict]) -> dict[int, float] | None:
    """The replicas' speed tables, averaged per batch size (replicas without one left out)."""
    sums: dict[int, list[float]] = {}
    for name, per_replica in metrics.items():
        if name.startswith(SPEED_PREFIX):
            values = [v for v in per_replica.values() if v is not None and v > 0]
            if values:
                sums[int(name[len(SPEED_PREFIX):])] = values
    return {b: sum(v) / len(v) for b, v in sums.items()} or None


def goodput_policy(ctx) -> tuple[int, dict]:
    """Serve's custom autoscaling policy hook (`autoscaling_config.policy.policy_function`); ctx is Serve's
    AutoscalingContext. Knobs come from policy_kwargs through ctx.config.policy.policy_kwargs."""
    metrics = ctx.aggregated_metrics or {}
    kwargs = ctx.config.policy.policy_kwargs or {}
    reported = sum(v for v in (metrics.get("ongoing") or {}).values() if v is not None)
    requests = max(float(ctx.total_num_requests or 0), reported)
    seqs = [v for v in (metrics.get("max_num_seqs") or {}).values() if v]
    n = desired_replicas(requests, merged_table(metrics), int(min(seqs)) if seqs else 16, ctx.current_num_replicas,
                         ctx.capacity_adjusted_max_replicas, kwargs.get("min_speed_fraction", 0.5),
                         ctx.config.get_target_ongoing_requests())
    return n, {"requests": requests, "decision": n}
