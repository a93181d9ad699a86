"""The serving load generator behind `smartspec bench serve` (its arguments: smartspec/bench/cli.py). It drives
any OpenAI-compatible endpoint (SmartSpec, vLLM, llama.cpp) with Poisson / gamma arrivals.

    smartspec bench serve --url http://127.0.0.1:8000 --model qwen2.5-coder-1.5b --label smartspec \
        --workload humaneval-chat --rates 0.05 0.1 0.2 --num-requests 16 --max-tokens 64

Per request: TTFT, TPOT, inter-token latency, end-to-end latency, output tokens. Per (label, rate): mean / p50 /
p99, throughput, and the server's spec-decode counters from /metrics (deltas over the run). Writes
<out>/<label>.parquet (per request) and <out>/<label>_summary.parquet, and redraws <out>/latency_vs_rate.png from
every label in <out>, so runs of several configurations (and servers) plot together."""
from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from smartspec.bench.report import plot_latency_vs_rate, print_table, summarise
from smartspec.bench.workloads import serving_requests

METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")
SPEC_COUNTERS = {  # ours and vLLM's names for the same counters
    "drafts": ("smartspec_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
    "draft_tokens": ("smartspec_spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "accepted_tokens": ("smartspec_spec_decode_num_accepted_tokens_total",
                        "vllm:spec_decode_num_accepted_tokens_total"),
}


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """Spec-decode counters summed over series (replicas); {} if the server has no /metrics."""
    try:
        text = client.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if not m:
            continue
        for key, names in SPEC_COUNTERS.items():
            if m.group(1) in names:
                totals[key] = totals.get(key, 0.0) + float(m.group(3))
    return totals


def arrival_times(rate: float, n: int, burstiness: float, seed: int) -> np.ndarray:
    """Gamma inter-arrivals with mean 1/rate; burstiness 1 = Poisson, < 1 burstier."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))


async def one_request(client: httpx.AsyncClient, url: str, body: dict, endpoint: str) -> dict:
    start = time.perf_counter()
    chunk_times, tokens, text, error = [], None, "", None
    try:
        async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as r:
            if r.status_code != 200:
                error = f"{r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices", []):
                        piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                        if piece:
                            chunk_times.append(time.perf_counter())
                            text += piece
    except httpx.HTTPError as exc:
        error = repr(exc)
    end = time.perf_counter()
    ttft = chunk_times[0] - start if chunk_times else None
    n = tokens if tokens is not None else len(chunk_times)
    itl = np.diff(chunk_times) if len(chunk_times) > 1 else np.array([])
    return {"start": start, "latency_s": end - start, "ttft_s": ttft, "output_tokens": n,
            "tpot_s": (end - chunk_times[0]) / (n - 1) if chunk_times and n > 1 else None,
            "itl_mean_s": float(itl.mean()) if len(itl) else None, "itl_p99_s": float(np.percentile(itl, 99))
            if len(itl) else None, "error": error, "text_chars": len(text)}


async def run_rate(url: str, model: str, requests: list[dict], rate: float, args) -> list[dict]:
    # rate 0: a closed loop of args.concurrency requests in flight (1: the no-load limit), each sent when one has
    # finished
    times = arrival_times(rate, len(requests), args.burstiness, args.seed) if rate > 0 else None
    in_flight = asyncio.Semaphore(args.concurrency)  # FIFO: the tasks below queue on it in request order
    # a fresh connection per request: a server that closes idle keep-alive connections (llama-server) would
    # otherwise fail a request sent on one it had just closed
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        t0, done, tasks = time.perf_counter(), 0, []

        async def fire(i: int, req: dict):
            if times is None:
                async with in_flight:
                    return await send(i, req, time.perf_counter() - t0)
            await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
            return await send(i, req, float(times[i]))

        async def send(i: int, req: dict, arrival: float):
            nonlocal done
            endpoint = req["endpoint"]
            body = {k: v for k, v in req.items() if k != "endpoint"}
            body.update(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                        stream_options={"include_usage": True}, ignore_eos=args.ignore_eos)
            if args.max_k is not None:  # a SmartSpec extension: cap speculation (0 = off) on the same server
                body["speculation"] = {"max_k": args.max_k}
            if args.seed is not None and args.temperature > 0:
                body["seed"] = args.seed + i
            row = await one_request(client, url, body, endpoint)
            done += 1
            print(f"\r[{args.label} @ {rate:g} req/s] {done}/{len(requests)} done", end="", file=sys.stderr,
                  flush=True)
            return {"request": i, "arrival_s": arrival, **row}

        tasks = [asyncio.create_task(fire(i, r)) for i, r in enumerate(requests)]
        rows = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    print(file=sys.stderr)
    for r in rows:
        r["run_wall_s"] = wall
    return rows


def spec_summary(counters: dict) -> dict:
    out = {f"spec_{k}": v for k, v in counters.items()}
    if counters.get("draft_tokens"):
        out["acceptance_rate"] = counters["accepted_tokens"] / counters["draft_tokens"]
    return out


def run(args) -> int:
    import pandas as pd

    if any(r < 0 for r in args.rates) or min(args.num_requests, args.max_tokens, args.concurrency) < 1 \
            or args.burstiness <= 0:
        print("smartspec bench serve: --rates must be >= 0 (0: --concurrency requests at a time); --num-requests, "
              "--max-tokens, --concurrency and --burstiness positive", file=sys.stderr)
        return 2
    rates = args.rates
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = serving_requests(args.workload, args.num_requests)
    rows, summaries = [], []
    with httpx.Client() as client:
        try:
            ready = client.get(f"{args.url}/v1/models", timeout=30).status_code == 200
        except httpx.HTTPError:
            ready = False
        if not ready:
            print(f"smartspec bench serve: {args.url}/v1/models does not answer", file=sys.stderr)
            return 1
        for rate in rates:
            before = scrape(client, args.url)
            rate_rows = asyncio.run(run_rate(args.url, args.model, requests, rate, args))
            after = scrape(client, args.url)
            counters = {k: after[k] - before.get(k, 0.0) for k in after}
            rows.append(pd.DataFrame(rate_rows).assign(label=args.label, rate=rate, workload=args.workload,
                                                       concurrency=args.concurrency if rate == 0 else None))
            summaries.append(summarise(rate_rows, args.label, rate, rate_rows[0]["run_wall_s"],
                                       {**spec_summary(counters),
                                        **({"concurrency": args.concurrency} if rate == 0 else {})}))
    pd.concat(rows).to_parquet(out / f"{args.label}.parquet")
    summary = pd.DataFrame(summaries)
    summary.to_parquet(out / f"{args.label}_summary.parquet")
    every = pd.concat([pd.read_parquet(p) for p in sorted(out.glob("*_summary.parquet"))]).to_dict("records")
    plot_latency_vs_rate(every, out / "latency_vs_rate.png")  # every configuration run into this folder
    print_table(summaries)
    return 1 if summary.errors.sum() else 0
