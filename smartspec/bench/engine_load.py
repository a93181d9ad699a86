"""Requests sent straight into one engine (no server) with Poisson arrivals, and what each one took: the load of
scripts/bench_policies.py and scripts/bench_proposers.py."""
from __future__ import annotations

import json
import random
import statistics
import time

from smartspec.engine.llm_engine import LLMEngine
from smartspec.types.sampling_params import SamplingParams


def run_rate(engine: LLMEngine, prompts: list[str], rate: float, max_tokens: int, seed: int) -> list[dict]:
    """The prompts arriving at `rate` a second (exponential gaps, seeded), stepped until all finish: per request its
    latency, TTFT, TPOT, tokens and draft counters."""
    rng = random.Random(seed)
    t, schedule = 0.0, []
    for p in prompts:  # Poisson arrivals: exponential gaps
        t += rng.expovariate(rate)
        schedule.append((t, p))
    params = SamplingParams(max_tokens=max_tokens)
    start = time.monotonic()
    arrival, done, pending = {}, {}, list(enumerate(schedule))
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0][1][0] <= now:
            i, (at, prompt) = pending.pop(0)
            rid = engine.add_request(prompt, params, request_id=f"q{i}")
            arrival[rid] = start + at
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        elif pending:
            time.sleep(max(0.0, pending[0][1][0] - (time.monotonic() - start)))
    rows = []
    for rid, out in done.items():
        m, n = out.metrics, len(out.token_ids)
        # per-source counters as JSON text: Parquet has no column type for an empty dict (a run that drafted nothing)
        spec = {f"spec_{k}": json.dumps(v) if isinstance(v, dict) else v
                for k, v in m.spec_decode.as_dict().items() if k != "accepted_per_position"}
        rows.append(dict(request=rid, latency_s=m.finish_time - arrival[rid],
                         ttft_s=m.first_token_time - arrival[rid],
                         tpot_s=(m.finish_time - m.first_token_time) / max(1, n - 1), output_tokens=n,
                         prompt_tokens=out.num_prompt_tokens, **spec))
    return rows


def summarize(rows: list[dict]) -> dict:
    """A run's latency (mean, median, p99), mean TTFT and TPOT, and tokens."""
    lat = sorted(r["latency_s"] for r in rows)
    return dict(mean_latency_s=statistics.mean(lat), p50_latency_s=statistics.median(lat),
                p99_latency_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                mean_ttft_s=statistics.mean(r["ttft_s"] for r in rows),
                mean_tpot_s=statistics.mean(r["tpot_s"] for r in rows),
                output_tokens=sum(r["output_tokens"] for r in rows))
